"""The official openai client, sync and async, streaming and not, against a real tiny-llama server."""

from __future__ import annotations

import openai
import pytest
from server_harness import MODEL, RunningServer

MESSAGES = [{"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Name a colour."}]


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def async_client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(server: RunningServer) -> None:
    models = client(server).models.list()
    assert [m.id for m in models.data] == [MODEL]


@pytest.mark.parametrize(("n", "max_tokens"), [(1, 6), (3, 4)])
def test_completion_returns_n_choices_with_usage(server: RunningServer, n: int,
                                                 max_tokens: int) -> None:
    out = client(server).completions.create(model=MODEL, prompt="The sky is", n=n,
                                            max_tokens=max_tokens, temperature=0.8, seed=7,
                                            extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == list(range(n))
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage is not None
    assert out.usage.completion_tokens == n * max_tokens
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_completion_batch_of_prompts_indexes_choices_per_prompt(server: RunningServer) -> None:
    out = client(server).completions.create(model=MODEL, prompt=["one", "two two"], n=2,
                                            max_tokens=3, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage is not None and out.usage.completion_tokens == 12


def test_completion_stream_deltas_add_up_to_the_whole_text(server: RunningServer) -> None:
    kwargs = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 12,
              "temperature": 0.0, "extra_body": {"ignore_eos": True}}
    whole = client(server).completions.create(**kwargs)
    chunks = list(client(server).completions.create(
        stream=True, stream_options={"include_usage": True}, **kwargs))
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 12
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_completion_logprobs_has_one_entry_per_token(server: RunningServer) -> None:
    out = client(server).completions.create(model=MODEL, prompt="abc", max_tokens=5, logprobs=3,
                                            extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert lp is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(len(top) <= 3 for top in lp.top_logprobs)


def test_same_seed_gives_same_text(server: RunningServer) -> None:
    def sample() -> str:
        return client(server).completions.create(model=MODEL, prompt="Seeded", max_tokens=8,
                                                 temperature=1.0, seed=1234).choices[0].text
    assert sample() == sample()


def test_stop_string_ends_the_text(server: RunningServer) -> None:
    kwargs = {"model": MODEL, "prompt": "Stop test", "max_tokens": 10, "temperature": 0.0,
              "extra_body": {"ignore_eos": True}}
    text = client(server).completions.create(**kwargs).choices[0].text
    assert text.strip(), f"greedy text {text!r} should have a visible character"
    stop = text.strip()[-1]
    out = client(server).completions.create(stop=[stop], **kwargs)
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.index(stop)]


def test_chat_completion_sync(server: RunningServer) -> None:
    out = client(server).chat.completions.create(model=MODEL, messages=MESSAGES,
                                                 max_completion_tokens=5, logprobs=True,
                                                 top_logprobs=2, extra_body={"ignore_eos": True})
    choice = out.choices[0]
    assert choice.message.role == "assistant"
    assert choice.finish_reason == "length"
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert len(choice.logprobs.content) == 5
    assert all(len(t.top_logprobs) == 2 for t in choice.logprobs.content)
    assert out.usage is not None and out.usage.completion_tokens == 5


def test_chat_completion_stream_sync(server: RunningServer) -> None:
    chunks = list(client(server).chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=6, stream=True, temperature=0.0,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6


async def test_async_client_completions_and_chat(server: RunningServer) -> None:
    aclient = async_client(server)
    out = await aclient.completions.create(model=MODEL, prompt="Async", max_tokens=4,
                                           extra_body={"ignore_eos": True})
    assert out.usage is not None and out.usage.completion_tokens == 4
    stream = await aclient.completions.create(model=MODEL, prompt="Async", max_tokens=4,
                                              stream=True, extra_body={"ignore_eos": True})
    pieces = [c.choices[0].text async for c in stream if c.choices]
    assert len(pieces) >= 1
    chat = await aclient.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=3,
                                                 extra_body={"ignore_eos": True})
    assert chat.choices[0].finish_reason == "length"
    chat_stream = await aclient.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=3, stream=True,
        extra_body={"ignore_eos": True})
    finishes = [c.choices[0].finish_reason async for c in chat_stream if c.choices]
    assert finishes[-1] == "length"
    await aclient.close()


def test_client_raises_the_documented_errors(server: RunningServer) -> None:
    with pytest.raises(openai.NotFoundError) as not_found:
        client(server).completions.create(model="no-such-model", prompt="x", max_tokens=2)
    assert not_found.value.body["param"] == "model"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as bad:
        client(server).completions.create(model=MODEL, prompt="x", max_tokens=100_000)
    assert bad.value.body["param"] == "max_tokens"  # type: ignore[index]
