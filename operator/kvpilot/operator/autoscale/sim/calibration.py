"""The simulator's cost model of one engine replica, read from `calibration.json`."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import TypeVar

import numpy as np

Batch = TypeVar("Batch", float, np.ndarray)
DEFAULT_PATH = Path(__file__).with_name("calibration.json")


@dataclass(frozen=True)
class CostModel:
    """How fast one replica prefills and decodes, and how much KV it holds."""

    prefill_tokens_per_s: float
    decode_step_base_s: float
    decode_step_per_seq_s: float
    decode_step_per_kv_token_s: float
    kv_capacity_tokens: int
    max_num_seqs: int
    startup_s: float
    """Seconds from a new pod's creation to its first served request."""
    gpus_per_replica: int = 1
    source: str = ""

    def decode_step_s(self, batch: Batch, kv_tokens_per_seq: float) -> Batch:
        """Gives one decode step's seconds at `batch` running sequences (the ITL); an array of
        batches (one per model) gives an array of steps."""
        return (self.decode_step_base_s + self.decode_step_per_seq_s * batch
                + self.decode_step_per_kv_token_s * batch * kv_tokens_per_seq)

    def decode_slots(self, tokens_per_seq: float) -> int:
        """Gives how many sequences of that final length fit one replica at once."""
        return int(min(self.max_num_seqs, self.kv_capacity_tokens // max(tokens_per_seq, 1)))

    def to_json(self) -> dict[str, object]:
        """Gives the JSON object `load` reads back."""
        out = asdict(self)
        return {"source": out.pop("source"), **out}


def load(path: str | Path = DEFAULT_PATH) -> CostModel:
    """Gives the cost model in `path`; unknown keys are an error naming the key."""
    raw = json.loads(Path(path).read_text())
    known = {f.name for f in fields(CostModel)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"{path}: unknown key(s) {', '.join(unknown)}: use only "
                         f"{', '.join(sorted(known))}")
    return CostModel(**raw)
