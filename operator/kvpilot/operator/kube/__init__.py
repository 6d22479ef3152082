"""The operator's Kubernetes API access: an async client (I/O) and the pure diff its apply uses."""
