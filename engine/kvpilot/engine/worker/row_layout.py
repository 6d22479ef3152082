"""Short multi-token entries as single-token rows, so that their step replays a decode graph.

The decode graphs (`cuda_graphs`) run steps whose entries all have one token. A
step with any longer entry (a prompt's chunk, a prompt tail after a prefix-cache
hit, a speculative verify) ran eagerly, and an eager forward costs the host far
more than a replay: 18-40 ms per step on an H100 host for the 0.6B and 8B shapes,
whatever its size, against a few ms for the whole replayed step
(`bench/results/serve_vs_offline-H100-2026-11-27/`).

Entry [t0..tq-1] at position p becomes q rows, row j = [tj] at position p + j over
the entry's blocks. Both attention backends write a step's K/V before they attend,
so row j sees t0..tj written in the same step: the causal attention the entry
had. Row j asks for the logits the entry had for tj ("all": every row; "last":
the last row only; "none": none), so the step's logits rows are the same rows in
the same order.

The price is reading: row j reads its whole context, p + j + 1 tokens, where the
prefill kernel reads the context once per tile of queries, so the entry reads
about (q - 1) p + q (q - 1) / 2 tokens more (less from memory: the rows of one
sequence share its blocks in the L2 cache). A step expands only when every entry
then has one token, its rows fit the largest captured graph, and the extra
tokens' K/V stay under the bytes of one read of the weights (on the H100 that is
0.4-5 ms of reading, against the eager step's 18-40 ms of host time).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvpilot.engine.worker.startup_log import LoadReport
from kvpilot.engine.worker.step_batch import BatchEntry

# the K/V bytes a step's rows may read beyond its entries', as a share of the weight bytes
EXTRA_READ_SHARE = 1.0
# "0" keeps every multi-token entry eager: the layout before this one, for side-by-side runs
ENV = "KVPILOT_ROW_LAYOUT"


def extra_tokens(entry: BatchEntry) -> int:
    """Gives the context tokens `entry`'s rows read beyond what the entry itself reads."""
    q, p = len(entry.token_ids), entry.start_pos
    return (q - 1) * p + q * (q - 1) // 2


def as_rows(entry: BatchEntry) -> list[BatchEntry]:
    """Gives `entry` as one single-token row per token, asking for the same logits rows."""
    last = len(entry.token_ids) - 1
    return [BatchEntry([token], entry.start_pos + j, entry.block_ids,
                       logits="last" if entry.logits == "all" or (
                           entry.logits == "last" and j == last) else "none",
                       lora_slot=entry.lora_slot)
            for j, token in enumerate(entry.token_ids)]


@dataclass(frozen=True)
class RowLayout:
    """When a step's multi-token entries run as single-token rows (see the module)."""

    max_rows: int  # the largest decode graph captured; 0: none (CPU, --enforce-eager)
    max_extra_tokens: int  # context tokens the rows may read beyond the entries' own

    @classmethod
    def of(cls, report: LoadReport) -> RowLayout:
        """Gives the layout for a runner that loaded and captured what `report` says."""
        if os.environ.get(ENV) == "0":
            return cls(0, 0)
        per_token = max(report.bytes_per_block // max(report.block_size, 1), 1)
        return cls(max(report.graph_sizes or (0,)),
                   int(report.weight_bytes * EXTRA_READ_SHARE) // per_token)

    def expand(self, entries: list[BatchEntry]) -> list[BatchEntry]:
        """Gives the entries the runner runs: `entries` itself, or all of them as single-token
        rows when those fit a captured graph within the read budget."""
        longer = [e for e in entries if len(e.token_ids) > 1]
        if not longer or not self.max_rows:
            return entries
        rows = sum(len(e.token_ids) for e in entries)
        if rows > self.max_rows or sum(map(extra_tokens, longer)) > self.max_extra_tokens:
            return entries
        out: list[BatchEntry] = []
        for entry in entries:
            if len(entry.token_ids) == 1:
                out.append(entry)
            else:
                out += as_rows(entry)
        return out
