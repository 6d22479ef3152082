"""KV connectors: KV blocks that live outside the GPU's prefix cache (a host-memory tier,
blocks pulled from a prefill engine), behind the seam the scheduler calls
(`core/kv_connector.py`)."""
