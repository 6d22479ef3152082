"""The KV connector seam: KV blocks that live outside the GPU's prefix cache (a host-memory
tier, blocks pulled from a prefill engine) found by the scheduler and loaded by the step."""
