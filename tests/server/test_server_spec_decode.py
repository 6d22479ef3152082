"""An engine core with --speculative-config behind the API server: completions work and
/metrics carries vLLM's spec_decode counters, per position too."""

from __future__ import annotations

import httpx
from server_harness import engine_core, serve_in_thread, tiny_app, wait_for

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}'


def test_speculating_server_completes_and_exports_spec_metrics():
    with engine_core(speculative_config=NGRAM) as core, \
            serve_in_thread(tiny_app(core)) as server:
        body = {"model": "tiny-llama", "prompt": [5, 6, 7, 8] * 8, "max_tokens": 24,
                "temperature": 0, "ignore_eos": True}
        reply = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 24
        assert wait_for(lambda: server.metric("vllm:spec_decode_num_drafts_total") > 0,
                        timeout=30)
        metrics = server.metrics()
        positions = {dict(labels)["position"] for name, labels in metrics
                     if name == "vllm:spec_decode_num_accepted_tokens_per_pos_total"}
        assert positions == {"0", "1", "2"}
        drafted = server.metric("vllm:spec_decode_num_draft_tokens_total")
        accepted = server.metric("vllm:spec_decode_num_accepted_tokens_total")
        assert 0 <= accepted <= drafted
