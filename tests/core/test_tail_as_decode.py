"""`--tail-as-decode-tokens`: a short tail joins the decode batch one token per step.

A decode engine behind the router gets each request with all but the last partial
block already in its prefix cache (a KV transfer). Computing that tail as a prefill
chunk makes the whole step eager (CUDA graphs replay only batches of one-token
rows) and stalls every running decode; computed one token per step, the tail rides
in the graph-replayed decode batch instead.
"""

from __future__ import annotations

from core_helpers import make_request, make_scheduler, run_step, scheduled_ids, seq_of

from kvpilot.engine.args import EngineArgs
from kvpilot.engine.llm_engine import LLMEngine
from kvpilot.engine.sampling_params import SamplingParams


def test_a_short_tail_runs_one_token_per_step_beside_decodes():
    scheduler = make_scheduler(block_size=4, tail_as_decode_tokens=4)
    scheduler.add(seq_of(make_request("running", 5, max_tokens=20)))
    run_step(scheduler)  # its prompt, then it decodes
    scheduler.add(seq_of(make_request("tail", 3)))
    plans = [scheduled_ids(run_step(scheduler)) for _ in range(3)]
    assert plans == [[("running", 1), ("tail", 1)]] * 3  # every step all one-token rows
    assert seq_of(scheduler.running[1].request).num_output_tokens == 1  # sampled after the 3rd


def test_long_remainders_and_idle_engines_keep_prefill_chunks():
    scheduler = make_scheduler(block_size=4, tail_as_decode_tokens=4)
    scheduler.add(seq_of(make_request("alone", 3)))
    assert scheduled_ids(run_step(scheduler)) == [("alone", 3)]  # nothing decoding: one chunk
    scheduler.add(seq_of(make_request("long", 9)))  # a failed transfer: the whole prompt
    assert ("long", 9) in scheduled_ids(run_step(scheduler))


def test_outputs_equal_with_and_without():
    """Greedy ids equal the default engine's, with prefixes cached and decodes running."""
    tail = 16
    outs, chunked_steps = {}, {}
    for value in (0, tail):
        engine = LLMEngine.from_engine_args(EngineArgs(
            model="tiny-llama", device="cpu", num_kv_blocks=128, block_size=16,
            tail_as_decode_tokens=value))
        steps: list[int] = []  # per step, the most tokens one sequence computed
        execute = engine.runner.execute
        engine.runner.execute = lambda entries, *a, _x=execute, _s=steps: (
            _s.append(max(len(e.token_ids) for e in entries)) or _x(entries, *a))
        shared = list(range(100, 164))  # four full blocks every prompt shares
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        engine.add_request("first", [*shared, 7, 8, 9], params)
        done = {}
        for step in range(200):
            if step == 3:  # arrive while "first" decodes: their tails are short
                for i in range(2):
                    engine.add_request(f"late{i}", shared + list(range(20, 25 + 3 * i)), params)
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
        outs[value] = done
        chunked_steps[value] = sum(n > 1 for n in steps)
        assert len(done) == 3
    assert outs[tail] == outs[0]
    # only the first prompt ran as a chunk; the late tails rode in decode steps
    assert (chunked_steps[0], chunked_steps[tail]) == (2, 1)
