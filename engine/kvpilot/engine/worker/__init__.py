"""One rank's worker: the model runner, a step packed into one buffer, row layout, decode
and piecewise CUDA graphs, device buffers, the sampler, and the start-up log lines."""
