"""The engine's side of migration: marked streams (`: token_ids ...` lines when the router
asks) and `resume` (a stream continued after the tokens another engine sent: no opening,
the same id and `created`, text and usage as one undisturbed stream); a drain hands marked
streams over after `--drain-handover-timeout`."""

from __future__ import annotations

import json
import signal
import time

import httpx
import pytest
from server_harness import MODEL, start_server

from kvpilot.engine.contracts.router_args import REQUEST_ID_HEADER, RESUMABLE_HEADER

MARKED = {RESUMABLE_HEADER: "1"}
CASES = {
    "completions_greedy": ("/v1/completions", {"prompt": "resume the story", "temperature": 0}),
    # a stop string holds back its length less one of the text: the continuation sends it
    "completions_held_back_text": ("/v1/completions", {"prompt": "resume the story",
                                                       "temperature": 0, "stop": ["@@never@@"]}),
    "chat_seeded": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                              "temperature": 1.0, "seed": 9}),
}


def parse(text: str) -> tuple[list[int], str, list[dict]]:
    """Gives (marked token ids, the text the events carry, the data events)."""
    ids, pieces, objects = [], [], []
    for event in text.split("\n\n"):
        for line in event.split("\n"):
            if line.startswith(": token_ids "):
                ids.extend(int(t) for t in line.split()[2:])
            elif line.startswith("data: {"):
                obj = json.loads(line[6:])
                objects.append(obj)
                for choice in obj.get("choices") or []:
                    pieces.append(choice.get("text") or (choice.get("delta") or {}).get(
                        "content") or "")
    return ids, "".join(pieces), objects


def post(server, path: str, body: dict, headers: dict | None = None) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json={"model": MODEL, **body},
                      headers=headers or {}, timeout=60)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_resumed_stream_continues_the_undisturbed_one(server, case):
    path, request = CASES[case]
    request = {**request, "max_tokens": 16, "ignore_eos": True, "stream": True,
               "stream_options": {"include_usage": True}}
    whole = post(server, path, request, MARKED)
    ids, text, objects = parse(whole.text)
    assert len(ids) == 16 and objects[-1]["usage"]["completion_tokens"] == 16
    assert ": token_ids" not in post(server, path, request).text  # only when asked
    first_id, created = objects[0]["id"], objects[0]["created"]
    # resume where a client can be: after whole events (a loaded server may send several
    # tokens in one event), near 0, 5 and 15 tokens
    ends = event_ends(whole.text)
    for k in sorted({0, *(min(ends, key=lambda e: abs(e - want)) for want in (5, 15))}):
        resumed = post(server, path, {**request, "resume": {"token_ids": ids[:k],
                                                            "created": created}},
                       {**MARKED, REQUEST_ID_HEADER: f"{first_id}"})
        rest_ids, rest_text, rest = parse(resumed.text)
        assert ids[:k] + rest_ids == ids, k
        sent = parse_text_up_to(whole.text, k)
        assert sent + rest_text == text, k
        assert {o["id"] for o in rest} == {first_id} and {o["created"] for o in rest} == {created}
        assert not any((c.get("delta") or {}).get("role") for o in rest for c in o["choices"])
        assert rest[-1]["usage"]["completion_tokens"] == 16  # counted once, all of them


def event_ends(text: str) -> list[int]:
    """Gives how many tokens the client has after each marked event of a stream."""
    ends, taken = [], 0
    for event in text.split("\n\n"):
        if event.startswith(": token_ids "):
            taken += len(event.split("\n")[0].split()[2:])
            ends.append(taken)
    return ends


def parse_text_up_to(text: str, k: int) -> str:
    """Gives the text of the events whose marks cover the first `k` tokens."""
    taken, pieces = 0, []
    for event in text.split("\n\n"):
        if taken >= k:
            break
        if event.startswith(": token_ids "):
            taken += len(event.split("\n")[0].split()[2:])
            pieces.append(parse(event + "\n\n")[1])
    return "".join(pieces)


def test_tokens_that_end_the_output_leave_only_usage_and_done(server):
    request = {"prompt": "short", "temperature": 0, "max_tokens": 4, "ignore_eos": True,
               "stream": True, "stream_options": {"include_usage": True}}
    ids, _, _ = parse(post(server, "/v1/completions", request, MARKED).text)
    text = post(server, "/v1/completions", {**request, "resume": {"token_ids": ids}},
                MARKED).text
    _, _, objects = parse(text)
    assert [o["choices"] for o in objects] == [[]] and objects[0]["usage"]["completion_tokens"] == 4
    assert text.endswith("data: [DONE]\n\n")


@pytest.mark.parametrize(("body", "message"), [
    ({"prompt": "x", "resume": {"token_ids": [1]}}, "send stream=true and n=1"),
    ({"prompt": "x", "stream": True, "n": 2, "resume": {"token_ids": []}}, "n=1"),
    ({"prompt": ["a", "b"], "stream": True, "resume": {"token_ids": []}}, "holds 2 prompts"),
    ({"prompt": "x", "stream": True, "max_tokens": 2, "resume": {"token_ids": [1, 2, 3]}},
     "more than max_tokens=2"),
    ({"prompt": "x", "stream": True, "resume": {"token_ids": [1], "extra": 1}}, "extra"),
])
def test_bad_resumes_get_400_naming_resume(server, body, message):
    response = post(server, "/v1/completions", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and (error["param"] or "").startswith("resume"), error


def test_a_drain_hands_marked_streams_over_and_lets_the_others_finish(tmp_path):
    proc, base = start_server(tmp_path / "serve.log", drain_timeout=60,
                              extra=("--drain-handover-timeout", "0"))
    try:
        body = {"model": MODEL, "prompt": "a long story", "max_tokens": 400, "ignore_eos": True,
                "stream": True}
        with httpx.Client(base_url=base, timeout=120) as client, \
                client.stream("POST", "/v1/completions", json=body, headers=MARKED) as marked, \
                client.stream("POST", "/v1/completions",
                              json={**body, "max_tokens": 60}) as plain:
            lines = marked.iter_lines()
            assert next(line for line in lines if line.startswith("data: {"))
            started = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            rest = "\n".join(lines)
            handed_over = time.monotonic() - started
            assert "handed this stream over" in rest and '"code": 503' in rest, rest[-500:]
            assert handed_over < 30, handed_over
            assert plain.read().decode().rstrip().endswith("data: [DONE]")  # it finished
        assert proc.wait(60) == 0
    finally:
        proc.kill()
        proc.wait(30)
