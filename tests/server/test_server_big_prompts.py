"""Request-size limits, and a huge prompt never holding up a small one (issue 49: a 16 MB
prompt got its 400 after 20.7 s, and a 2-token request sent meanwhile took 20.25 s)."""

from __future__ import annotations

import threading
import time

import httpx
import psutil
from server_harness import MODEL, RunningServer, start_server, wait_for

SMALL = {"model": MODEL, "prompt": "hello", "max_tokens": 2}
BIG_BYTES = 16 * 1024 * 1024


def big_prompt(chars: int) -> dict[str, object]:
    return {"model": MODEL, "prompt": "lorem ipsum dolor sit amet " * (chars // 27),
            "max_tokens": 2}


def test_a_body_over_the_limit_is_a_413_naming_the_flag(server: RunningServer) -> None:
    limits = server.app.state.request_limits  # sized from max_model_len=512
    assert limits.max_request_bytes < BIG_BYTES
    url = f"{server.base_url}/v1/completions"
    big = httpx.post(url, json=big_prompt(BIG_BYTES), timeout=60)
    assert big.status_code == 413, big.text
    error = big.json()["error"]
    assert "--max-request-bytes" in error["message"] and error["type"] == "invalid_request_error"

    def chunks():  # no Content-Length: counted while read
        for _ in range(limits.max_request_bytes // 65536 + 2):
            yield b" " * 65536

    chunked = httpx.post(url, content=chunks(), timeout=60,
                         headers={"content-type": "application/json"})
    assert chunked.status_code == 413
    assert httpx.post(url, json=SMALL, timeout=60).status_code == 200


def test_a_prompt_that_cannot_fit_is_refused_before_tokenising(server: RunningServer) -> None:
    limits = server.app.state.request_limits
    body = big_prompt(limits.max_prompt_chars + 100)
    start = time.monotonic()
    resp = httpx.post(f"{server.base_url}/v1/completions", json=body, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt"
    assert "--max-prompt-chars" in resp.json()["error"]["message"]
    chat = {"model": MODEL, "messages": [{"role": "user", "content": body["prompt"]}]}
    resp = httpx.post(f"{server.base_url}/v1/chat/completions", json=chat, timeout=60)
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "messages"
    print(f"refused unread in {time.monotonic() - start:.3f} s")


def test_small_requests_pass_a_huge_prompt_being_tokenised(tmp_path) -> None:
    """Limits raised so a 2 MB prompt is tokenised (~2 s of CPU here) and a 16 MB one is
    read and refused by its length: small requests sent meanwhile finish first, each
    within a few hundred ms (before, they queued behind the tokenising)."""
    proc, base = start_server(tmp_path / "serve.log",
                              extra=("--max-prompt-chars", "2500000",
                                     "--max-request-bytes", str(2 * BIG_BYTES)))
    try:
        url = f"{base}/v1/completions"
        with httpx.Client(timeout=120) as client:
            baseline = []
            for _ in range(3):
                start = time.monotonic()
                assert client.post(url, json=SMALL).status_code == 200
                baseline.append(time.monotonic() - start)
        rss_before = psutil.Process(proc.pid).memory_info().rss
        finished: dict[str, float] = {}
        statuses: dict[str, int] = {}

        def send(name: str, body: dict[str, object]) -> None:
            statuses[name] = httpx.post(url, json=body, timeout=300).status_code
            finished[name] = time.monotonic()

        bigs = [threading.Thread(target=send, args=(name, big_prompt(size)))
                for name, size in (("16MB", BIG_BYTES), ("2MB", 2_000_000))]
        for thread in bigs:
            thread.start()
        time.sleep(0.3)  # both sent and being read or tokenised
        small: list[tuple[float, float]] = []  # (sent, finished)
        with httpx.Client(timeout=120) as client:
            while "2MB" not in finished and len(small) < 20:
                start = time.monotonic()
                assert client.post(url, json=SMALL).status_code == 200
                small.append((start, time.monotonic()))
        for thread in bigs:
            thread.join(300)
        assert statuses == {"16MB": 400, "2MB": 400}  # too many characters; too many tokens
        rss_after = psutil.Process(proc.pid).memory_info().rss
        latencies = sorted(end - start for start, end in small)
        print(f"baseline {max(baseline) * 1e3:.0f} ms; while tokenising {len(small)} small "
              f"requests, median {latencies[len(latencies) // 2] * 1e3:.0f} ms, max "
              f"{latencies[-1] * 1e3:.0f} ms; 2 MB answered after "
              f"{finished['2MB'] - small[0][0]:.2f} s; API server RSS "
              f"{rss_before / 2**20:.0f} -> {rss_after / 2**20:.0f} MiB")
        # ordering: the first small requests were answered while the 2 MB one was tokenised
        assert len(small) >= 3 and all(end < finished["2MB"] for _, end in small[:3])
        assert latencies[len(latencies) // 2] < 1.0  # generous: queued, it was seconds
        assert rss_after - rss_before < 256 * 2**20  # the prompts' memory went back
    finally:
        proc.terminate()
        proc.wait(30)
        assert wait_for(lambda: proc.poll() is not None, 5)
