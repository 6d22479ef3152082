"""The model as the engine loop drives it (`ModelExecutor`): one rank in process, or many
ranks over worker processes (tensor and pipeline parallel), their step channels and the
pipeline's batch queue."""
