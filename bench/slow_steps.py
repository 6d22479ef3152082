"""Summarizes the engines' slow-iteration log lines (`KVPILOT_SLOW_STEP_MS`).

    python bench/slow_steps.py LOG [LOG ...]

For each log: how many iterations were slow, their p50/p99/max, and how many of them
coincided with each suspect (a request added, a KV transfer running, a lock wait,
a GPU wait or GC above a quarter of the iteration, host time in the step otherwise),
the mean of each phase of the engine step where the lines carry them, then the ten
slowest lines.
"""

from __future__ import annotations

import re
import sys

LINE = re.compile(
    r"slow engine iteration: (?P<total>[\d.]+) ms \(inbox (?P<inbox>[\d.]+) ms, (?P<adds>\d+) adds; "
    r"step (?P<step>[\d.]+) ms: (?:lock wait (?P<lock>[\d.]+) ms, )?GPU wait (?P<gpu>[\d.]+) ms"
    r"(?: \[(?P<phases>[^\]]*)\])?(?:, KV transfers running (?P<transfers>\d+))?; "
    r"deliver (?P<deliver>[\d.]+) ms; GC (?P<gc>[\d.]+) ms\)")
PHASE = re.compile(r"(\w+) ([\d.]+)")


def summarize(path: str) -> list[str]:
    rows = []
    with open(path, errors="replace") as log:
        for text in log:
            if match := LINE.search(text):
                fields = match.groupdict()
                phases = (fields.pop("phases") or "").split(";")[0]
                row = {k: float(v or 0) for k, v in fields.items()}
                row.update({f"phase {name}": float(ms) for name, ms in PHASE.findall(phases)})
                rows.append((row, text))
    if not rows:
        return [f"{path}: no slow iterations"]
    totals = sorted(r["total"] for r, _ in rows)

    def share(test) -> str:
        return f"{sum(1 for r, _ in rows if test(r))}"

    out = [f"{path}: {len(rows)} slow iterations, p50 {totals[len(totals) // 2]:.1f} ms, "
           f"p99 {totals[int(len(totals) * 0.99)]:.1f} ms, max {totals[-1]:.1f} ms; with "
           f"adds {share(lambda r: r['adds'] > 0)}, transfers {share(lambda r: r['transfers'] > 0)}, "
           f"lock wait {share(lambda r: r['lock'] > r['total'] / 4)}, "
           f"GPU wait {share(lambda r: r['gpu'] > r['total'] / 4)}, "
           f"GC {share(lambda r: r['gc'] > r['total'] / 4)}, host in step "
           f"{share(lambda r: r['step'] - r['gpu'] - r['lock'] > r['total'] / 2)}"]
    phases = sorted({k for r, _ in rows for k in r if k.startswith("phase ")})
    if phases:  # the engine step's own phases (LLMEngine.step_timing), mean over the lines
        out.append("  mean ms: " + ", ".join(
            f"{k[6:]} {sum(r.get(k, 0.0) for r, _ in rows) / len(rows):.1f}" for k in phases))
    out += ["  " + text.strip().split("WARNING ")[-1]
            for _, text in sorted(rows, key=lambda row: -row[0]["total"])[:10]]
    return out


if __name__ == "__main__":
    for name in sys.argv[1:]:
        print("\n".join(summarize(name)))
