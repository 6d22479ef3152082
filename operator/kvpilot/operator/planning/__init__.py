"""Pure planning: replica topology, accelerator placement and NCCL/RCCL environment."""
