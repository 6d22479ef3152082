"""`kvpilot generate` prints completions and turns bad flags into a message and exit code 2."""

from __future__ import annotations

import json

import pytest

from kvpilot.cli.main import main


def test_generate_prints_json_completions(capsys):
    code = main(["generate", "--model", "tiny-llama", "--prompt", "Hello", "--prompt", "Bye",
                 "--max-tokens", "5", "--ignore-eos", "--json", "--num-kv-blocks", "16"])
    assert code == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line["prompt"] for line in lines] == ["Hello", "Bye"]
    assert all(len(line["completions"][0]["token_ids"]) == 5 for line in lines)
    assert all(line["completions"][0]["finish_reason"] == "length" for line in lines)


def test_generate_reports_a_bad_value(capsys):
    code = main(["generate", "--model", "tiny-llama", "--prompt", "Hi", "--max-tokens", "0",
                 "--num-kv-blocks", "16"])
    assert code == 2
    assert "max_tokens=0 is invalid" in capsys.readouterr().err


def test_generate_without_a_model_names_the_built_in(capsys):
    assert main(["generate", "--prompt", "Hi"]) == 2
    assert "`kvpilot generate --model tiny-llama` serves the built-in" in capsys.readouterr().err


@pytest.mark.parametrize("flags", [
    ["--role", "prefill"], ["--port", "8000"], ["--api-server-count", "2"],
    ["--fleet-secret-file", "/tmp/secret"], ["--insecure-kv"], ["--no-insecure-kv"],
    ["--kv-transport", "nixl"], ["--served-model-name", "m"], ["--enable-lora"],
    ["--lora-modules", "a=/x"], ["--api-key", "k"], ["--chat-template", "{{ x }}"],
])
def test_generate_refuses_the_flags_of_a_server_by_name(capsys, flags):
    """`kvpilot generate --role prefill` ran and ignored the flag (issue 49)."""
    with pytest.raises(SystemExit) as exit_:
        main(["generate", "--model", "tiny-llama", "--prompt", "Hi", *flags])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith(f"kvpilot generate: error: {flags[0]} is a flag of `kvpilot serve`")


def test_generate_help_lists_only_offline_flags(capsys):
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    out = capsys.readouterr().out
    for offline in ("--prompt", "--max-tokens", "--model", "--max-model-len", "--dtype",
                    "--tensor-parallel-size", "--speculative-config"):
        assert offline in out
    for serving in ("--role", "--port", "--host", "--api-server-count", "--fleet-secret-file",
                    "--insecure-kv", "--kv-transfer-port", "--enable-lora", "--api-key",
                    "--served-model-name", "--max-queue-len", "--drain-timeout"):
        assert serving not in out, serving


def test_generate_with_an_unknown_model_names_no_server(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert main(["generate", "--model", "acme/not-here", "--prompt", "Hi"]) == 2
    err = capsys.readouterr().err
    assert "`kvpilot fetch acme/not-here --local-dir DIR` and give DIR as the model" in err
    assert "serve" not in err, err
