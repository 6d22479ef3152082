"""Every topology the engine cannot run is refused at start-up, before any weight or process,
with the flag, the value and what is supported; the ones it runs pass."""

from __future__ import annotations

import subprocess
import sys

import psutil
import pytest

from kvpilot.engine.contracts.builtin_models import BUILTIN_CONFIGS
from kvpilot.engine.contracts.rendezvous import Rendezvous, RendezvousError
from kvpilot.engine.entrypoints.llm import LLM
from kvpilot.engine.models.config import ModelConfig
from kvpilot.engine.parallel.config import ParallelConfig, ParallelConfigError, validate

LLAMA = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-llama"])  # 4 heads, 2 KV heads, MLP 256
MIXTRAL = ModelConfig.from_hf(BUILTIN_CONFIGS["tiny-mixtral"])  # 4 experts of 128


def shape(base: str = "tiny-llama", **hf) -> ModelConfig:
    return ModelConfig.from_hf({**BUILTIN_CONFIGS[base], **hf})


# (id, (tp, pp, ep), model, device, visible GPUs, role, message)
REFUSED = [
    ("pp-over-layers", (1, 3, 1), LLAMA, "cpu", 0, "both",
     "--pipeline-parallel-size=3 does not fit the model's 2 layers: each stage holds at least "
     "one whole layer; use 1 to 2"),
    ("pp-zero", (1, 0, 1), LLAMA, "cpu", 0, "both",
     "--pipeline-parallel-size=0 does not fit the model's 2 layers"),
    ("pp-gpus", (2, 2, 1), LLAMA, "cuda", 2, "both",
     "--tensor-parallel-size=2 --pipeline-parallel-size=2 needs 4 GPUs on this node but 2 are "
     "visible"),
    ("pp-role", (1, 2, 1), LLAMA, "cpu", 0, "decode",
     "--role decode with --expert-parallel-size=1 --pipeline-parallel-size=2 is not "
     "supported: pulled KV is re-sharded for tensor parallelism only"),
    ("tp-heads", (3, 1, 1), LLAMA, "cpu", 0, "both",
     "--tensor-parallel-size=3 does not divide the model's 4 attention heads: each rank needs "
     "whole heads; use one of 1, 2, 4"),
    ("tp-over-kv-not-multiple", (6, 1, 1),
     shape(num_attention_heads=12, num_key_value_heads=4, head_dim=8), "cpu", 0, "both",
     "--tensor-parallel-size=6 exceeds the model's 4 KV heads but is not a multiple of them"),
    ("tp-not-dividing-kv", (4, 1, 1),
     shape(num_attention_heads=12, num_key_value_heads=6, head_dim=8), "cpu", 0, "both",
     "--tensor-parallel-size=4 does not divide the model's 6 KV heads: use one of 1, 2, 3, 6"),
    ("tp-intermediate", (4, 1, 1), shape(intermediate_size=250), "cpu", 0, "both",
     "--tensor-parallel-size=4 does not divide the model's intermediate size 250"),
    ("tp-expert-intermediate", (4, 1, 4), shape("tiny-mixtral", intermediate_size=130), "cpu",
     0, "both", "does not divide the model's experts' intermediate size 130"),
    ("ep-dense", (2, 1, 2), LLAMA, "cpu", 0, "both",
     "--expert-parallel-size=2 but LlamaForCausalLM is a dense model (no experts): use "
     "--expert-parallel-size 1"),
    ("ep-experts", (3, 1, 3),
     shape("tiny-mixtral", num_attention_heads=12, num_key_value_heads=12, head_dim=8,
           intermediate_size=96), "cpu", 0, "both",
     "--expert-parallel-size=3 does not divide the model's 4 experts: use one of 1, 2, 4"),
    ("ep-between-one-and-tp", (4, 1, 2), MIXTRAL, "cpu", 0, "both",
     "--expert-parallel-size=2 with --tensor-parallel-size=4 is not supported: experts are "
     "split across a layer's tensor-parallel ranks, so use --expert-parallel-size 4"),
    ("gpus", (2, 1, 1), LLAMA, "cuda", 1, "both",
     "--tensor-parallel-size=2 needs 2 GPUs on this node but 1 are visible"),
    ("role", (2, 1, 1), LLAMA, "cpu", 0, "prefill",
     "--role prefill with --tensor-parallel-size=2 is not supported: the KV transfer moves one "
     "rank's whole cache"),
]


@pytest.mark.parametrize(("topology", "config", "device", "visible", "role", "message"),
                         [r[1:] for r in REFUSED], ids=[r[0] for r in REFUSED])
def test_refused(topology, config, device, visible, role, message):
    with pytest.raises(ParallelConfigError) as err:
        validate(ParallelConfig(*topology), config, device, visible, role)
    assert message in str(err.value)


# (id, (tp, pp, ep), model, device, visible GPUs)
ACCEPTED = [
    ("one-rank", (1, 1, 1), LLAMA, "cpu", 0),
    ("tp2", (2, 1, 1), LLAMA, "cpu", 0),
    ("tp4-replicates-kv", (4, 1, 1), LLAMA, "cpu", 0),
    ("tp2-on-2-gpus", (2, 1, 1), LLAMA, "cuda", 2),
    ("mixtral-ep1", (2, 1, 1), MIXTRAL, "cpu", 0),
    ("mixtral-ep-equals-tp", (4, 1, 4), MIXTRAL, "cpu", 0),
    ("pp2", (1, 2, 1), LLAMA, "cpu", 0),
    ("tp2-pp2-on-4-gpus", (2, 2, 1), LLAMA, "cuda", 4),
]


@pytest.mark.parametrize(("topology", "config", "device", "visible"),
                         [a[1:] for a in ACCEPTED], ids=[a[0] for a in ACCEPTED])
def test_accepted(topology, config, device, visible):
    validate(ParallelConfig(*topology), config, device, visible)


def test_async_scheduling_on_is_refused_with_pp():
    validate(ParallelConfig(1, 2), LLAMA, "cpu", 0, async_scheduling="auto")
    with pytest.raises(ParallelConfigError) as err:
        validate(ParallelConfig(1, 2), LLAMA, "cpu", 0, async_scheduling="on")
    assert str(err.value) == (
        "--async-scheduling on with --pipeline-parallel-size=2 is not supported: pipeline "
        "stages overlap batches instead; use --async-scheduling auto or off")


def test_ranks_per_node_count_against_the_node_gpus():
    """A multi-node group needs only its own ranks' GPUs on each node."""
    validate(ParallelConfig(4), LLAMA, "cuda", 2, ranks_per_node=2)
    with pytest.raises(ParallelConfigError, match="needs 4 GPUs on this node but 2"):
        validate(ParallelConfig(4), LLAMA, "cuda", 2)


GROUP = {"MASTER_ADDR": "m-g0-0.m-workers.ns.svc", "MASTER_PORT": "29500", "WORLD_SIZE": "16",
         "NNODES": "2", "NODE_RANK": "1"}
# (id, env, world size from the flags, message)
BAD_ENV = [
    ("missing", {"NODE_RANK": "0", "WORLD_SIZE": "2"}, 2,
     "NODE_RANK='0' is set but MASTER_ADDR, MASTER_PORT, NNODES is not"),
    ("not-int", {**GROUP, "NNODES": "two"}, 16, "NNODES='two' is not an integer"),
    ("world", GROUP, 8, "WORLD_SIZE=16 in the environment but --tensor-parallel-size x "
                        "--pipeline-parallel-size = 8"),
    ("nodes", {**GROUP, "NNODES": "3"}, 16, "NNODES=3 does not divide WORLD_SIZE=16"),
    ("rank", {**GROUP, "NODE_RANK": "2"}, 16, "NODE_RANK=2 is outside 0..1"),
]


@pytest.mark.parametrize(("env", "world", "message"), [b[1:] for b in BAD_ENV],
                         ids=[b[0] for b in BAD_ENV])
def test_rendezvous_env_refused(env, world, message):
    with pytest.raises(RendezvousError) as err:
        Rendezvous.from_env(env, world)
    assert message in str(err.value)


def test_no_node_rank_means_one_node():
    assert Rendezvous.from_env({"MASTER_ADDR": "x", "WORLD_SIZE": "4"}, 2) is None


def test_llm_refuses_before_starting_anything():
    children = len(psutil.Process().children(recursive=True))
    with pytest.raises(ParallelConfigError, match="--tensor-parallel-size=3 does not divide"):
        LLM("tiny-llama", tensor_parallel_size=3)
    assert len(psutil.Process().children(recursive=True)) == children


def test_llm_refuses_pp_with_async_scheduling_before_starting_anything():
    children = len(psutil.Process().children(recursive=True))
    with pytest.raises(ParallelConfigError, match="--async-scheduling on with "
                                                  "--pipeline-parallel-size=2"):
        LLM("tiny-llama", pipeline_parallel_size=2, async_scheduling="on")
    assert len(psutil.Process().children(recursive=True)) == children


def test_serve_exits_2_naming_the_flag():
    result = subprocess.run(
        [sys.executable, "-m", "kvpilot.cli.main", "serve", "--model", "tiny-mixtral",
         "--device", "cpu", "--tensor-parallel-size", "2", "--expert-parallel-size", "8"],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert "kvpilot serve: --expert-parallel-size=8 does not divide the model's 4 experts" \
        in result.stderr
