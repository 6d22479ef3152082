"""Tensor and expert parallelism: topology checks, process groups, sharded layers, the
multi-rank executor and its worker processes."""
