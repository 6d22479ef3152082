"""Tensor, pipeline and expert parallelism below the model: topology checks, process groups
and their collectives (the symmetric-memory all-reduce), pipeline stages. The sharded layers
live in `models/parallel_layers.py`; the multi-rank executor and its worker processes in
`executor/`."""
