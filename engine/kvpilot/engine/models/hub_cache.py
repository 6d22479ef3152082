"""A model named by its Hub id, found in the local Hugging Face cache; never a download.

huggingface_hub lays a repository out as `<cache>/models--<org>--<name>/refs/main` (the
commit) and `snapshots/<commit>/` (the files); the cache is `HF_HUB_CACHE`, else
`HF_HOME/hub`, else `~/.cache/huggingface/hub`. `kvpilot serve org/name` serves that
snapshot, as `vllm serve org/name` does once the files are there.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from kvpilot.engine.contracts.args import EngineArgs
from kvpilot.engine.contracts.builtin_models import BUILTIN_CONFIGS, is_builtin


def hub_cache_dir() -> Path:
    """Gives the Hugging Face hub cache directory the environment names."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "huggingface")
    return Path(home) / "hub"


def cached_snapshot(repo: str, revision: str = "main") -> Path | None:
    """Gives the snapshot directory of `repo` at `revision` in the local cache, or None."""
    root = hub_cache_dir() / f"models--{repo.replace('/', '--')}"
    ref = root / "refs" / revision
    commit = ref.read_text().strip() if ref.is_file() else revision
    snapshot = root / "snapshots" / commit
    if snapshot.is_dir():
        return snapshot
    snapshots = sorted(p for p in (root / "snapshots").glob("*") if p.is_dir()) \
        if (root / "snapshots").is_dir() else []
    return snapshots[0] if len(snapshots) == 1 and not ref.is_file() else None


def local_model(model: str) -> str:
    """Gives where `model` is: itself for a built-in config or an existing path, else the local
    snapshot of a Hub id; raises ValueError naming the fix when it is none of these."""
    if is_builtin(model) or Path(model).exists():
        return model
    snapshot = cached_snapshot(model) if model.count("/") == 1 else None
    if snapshot is not None:
        return str(snapshot)
    raise ValueError(
        f"model={model!r} is not a directory, not a built-in config "
        f"({', '.join(BUILTIN_CONFIGS)}) and not in the local Hugging Face cache "
        f"({hub_cache_dir()}): download it first (`hf download {model}`, or `kvpilot fetch "
        f"{model} --local-dir DIR` and give DIR as the model); kvpilot never downloads weights "
        "itself")


def with_local_model(args: EngineArgs) -> EngineArgs:
    """Gives `args` with the model where it is (`local_model`); clients keep using the name
    they gave (a Hub id stays the served model name)."""
    local = local_model(args.model)
    return args if local == args.model else replace(args, model=local,
                                                     served_model_name=args.name)
