"""`kvpilot bench throughput` and `kvpilot bench latency`: the offline engine timed the way
`vllm bench throughput` and `vllm bench latency` time vLLM's."""
