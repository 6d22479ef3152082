"""`kvpilot generate` prints completions and turns bad flags into a message and exit code 2."""

from __future__ import annotations

import json

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
