"""Draws a simulation run: load and replicas over time, as a PNG (matplotlib, Agg backend)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvpilot.operator.autoscale.sim.fleet import SimTrace

MAX_POINTS = 2000


def _bins(ticks: int) -> int:
    return max(1, -(-ticks // MAX_POINTS))


def draw(trace: SimTrace, path: str | Path, title: str = "") -> Path:
    """Writes the run's load (requests/s) and prefill/decode replicas to `path`; gives it."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("drawing the simulation needs matplotlib: "
                           "pip install 'kvpilot[sim]' (or drop --png)") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ticks = trace.arrivals.shape[0]
    step = _bins(ticks)
    usable = ticks - ticks % step
    hours = (np.arange(usable // step) * step + step / 2) * trace.tick_s / 3600
    rate = trace.arrivals[:usable].sum(axis=1).reshape(-1, step).sum(axis=1) / (step * trace.tick_s)
    replicas = trace.replicas[:usable].reshape(-1, step, 2).max(axis=1)
    ready = trace.ready[:usable].reshape(-1, step, 2).min(axis=1)

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(10, 6), sharex=True)
    top.plot(hours, rate, color="tab:gray")
    top.set_ylabel("requests/s")
    top.set_title(title or "load and replicas")
    for role, index, color in (("prefill", 0, "tab:blue"), ("decode", 1, "tab:orange")):
        bottom.step(hours, replicas[:, index], where="mid", color=color, label=f"{role} spec")
        bottom.step(hours, ready[:, index], where="mid", color=color, alpha=0.4,
                    linestyle="--", label=f"{role} ready")
    bottom.set_ylabel("replicas")
    bottom.set_xlabel("hours")
    bottom.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
