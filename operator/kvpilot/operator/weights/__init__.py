"""Model weights: where they come from, the download a pod or Job runs, and what the operator sees of it."""
