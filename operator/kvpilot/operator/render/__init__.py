"""Pure render functions: specs in, lists of Kubernetes object dicts out (no I/O)."""
