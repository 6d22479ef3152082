"""`kvpilot serve --enable-auto-tool-choice --tool-call-parser` (vLLM's flags): refused when
incomplete, and a served tiny-llama parses the Hermes calls of tool_choice=auto."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from server_harness import start_server
from test_server_structured_openai import HERMES_TEMPLATE, TOOLS

from kvpilot.cli.main import main


def test_auto_tool_choice_without_a_parser_is_refused(capsys: pytest.CaptureFixture[str]):
    assert main(["serve", "tiny-llama", "--device", "cpu", "--enable-auto-tool-choice"]) == 2
    assert "needs tool_call_parser: pass --tool-call-parser (hermes or llama3_json)" \
        in capsys.readouterr().err


def test_an_unknown_parser_is_refused(capsys: pytest.CaptureFixture[str]):
    with pytest.raises(SystemExit):
        main(["serve", "tiny-llama", "--tool-call-parser", "mistral"])
    assert "invalid choice: 'mistral'" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [(), ("--enable-auto-tool-choice", "--tool-call-parser",
                                        "hermes")])
def test_served_auto_tool_choice_follows_the_flags(tmp_path: Path, flags: tuple[str, ...]):
    template = tmp_path / "hermes.jinja"
    template.write_text(HERMES_TEMPLATE)
    proc, base = start_server(tmp_path / "serve.log",
                              extra=("--chat-template", str(template), *flags))
    regex = r'<tool_call>\{"name": "now", "arguments": \{\}\}</tool_call>'
    body = {"model": "tiny-llama", "max_tokens": 60, "tools": TOOLS,
            "messages": [{"role": "user", "content": "time?"}],
            "structured_outputs": {"regex": regex}}
    try:
        resp = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if not flags:
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "tool_choice"
        return
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    [call] = choice["message"]["tool_calls"]
    assert (call["function"]["name"], json.loads(call["function"]["arguments"])) == ("now", {})
