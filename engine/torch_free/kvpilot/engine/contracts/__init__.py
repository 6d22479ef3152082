"""The engine's torch-free contracts: what the operator, the router and the engine share.

Engine and router flags (`args`, `router_args`), metric names and the Prometheus text
reader, the prefix block hash, the KV-transfer wire protocol (`kv_protocol`, its
handshake `kv_auth`, the requests `kv_client`), the fleet secret and which HTTP path takes
which credential (`fleet_secret`, `http_auth`), the request/output values and the
tokenizer protocol. Nothing here imports torch: the operator image ships this package without it.
"""
