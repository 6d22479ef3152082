"""Draws a simulation run as a PNG (matplotlib, Agg backend): load, replicas per pool, latency
against the SLO, the share of requests within it, and GPU-hours, over one time axis."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from kvpilot.operator.autoscale.sim.fleet import SimTrace, Workload
from kvpilot.operator.autoscale.sim.report import slo_met

if TYPE_CHECKING:
    from matplotlib.figure import Figure

MAX_POINTS = 2000
COLORS = {"prefill": "tab:blue", "decode": "tab:orange", "both": "tab:green"}


def _bins(ticks: int) -> int:
    return max(1, -(-ticks // MAX_POINTS))


def draw(trace: SimTrace, path: str | Path, title: str = "",
         workload: Workload | None = None) -> Path:
    """Writes the run's panels (`figure`) to `path`; gives the path."""
    fig = figure(trace, title, workload)  # first: it says when matplotlib is missing
    import matplotlib.pyplot as plt

    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def figure(trace: SimTrace, title: str = "", workload: Workload | None = None) -> Figure:
    """Gives the run's five panels, each line named in its panel's legend.

    `workload` gives the SLO the latency and attainment panels compare with (default: the
    simulator's default workload). Raises RuntimeError when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError as exc:
        raise RuntimeError("drawing the simulation needs matplotlib: "
                           "pip install 'kvpilot[sim]' (or drop --png)") from exc

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workload = workload or Workload()
    ticks = trace.arrivals.shape[0]
    step = _bins(ticks)
    usable = ticks - ticks % step
    bins = usable // step

    def binned(values: np.ndarray, how: str = "mean") -> np.ndarray:
        shaped = values[:usable].reshape(bins, step, *values.shape[1:])
        return getattr(np, how)(shaped, axis=1)

    hours = (np.arange(bins) * step + step / 2) * trace.tick_s / 3600
    arrivals = trace.arrivals.sum(axis=1)
    fig, (load, pools, latency, within, gpus) = plt.subplots(5, 1, figsize=(10, 12),
                                                             sharex=True)
    load.plot(hours, binned(arrivals, "sum") / (step * trace.tick_s), color="tab:gray",
              label="arrivals, all models")
    load.set_ylabel("requests/s")
    load.set_title(title or "load, replicas, latency, SLO and GPU-hours")

    spec, ready = binned(trace.replicas, "max"), binned(trace.ready, "min")
    for role, column in trace.pools():
        color = COLORS[role]
        # ready first, wide and pale, so the spec line on top never hides it
        pools.step(hours, ready[:, column], where="mid", color=color, linewidth=5, alpha=0.3,
                   label=f"{role}: ready (serving)")
        pools.step(hours, spec[:, column], where="mid", color=color, linewidth=1.2,
                   label=f"{role}: spec (GPUs held, starting pods included)")
    pools.set_ylabel("replicas")

    # the worst model's latency, as a fraction of its SLO: above 1 the SLO is missed
    latency.plot(hours, binned(trace.itl_s.max(axis=1), "max") / workload.itl_slo_s,
                 color="tab:purple", label=f"decode step (ITL) / {workload.itl_slo_s * 1000:g} ms")
    latency.plot(hours, binned(trace.prefill_sojourn_s.max(axis=1), "max") / workload.ttft_slo_s,
                 color="tab:red", label=f"prefill wait + compute / TTFT SLO {workload.ttft_slo_s:g} s")
    latency.axhline(1.0, color="black", linestyle=":", linewidth=1, label="SLO")
    latency.set_ylim(0, max(1.25, latency.get_ylim()[1]))  # the SLO line always in view
    latency.set_ylabel("latency / SLO")

    met = slo_met(trace, workload)  # NaN: the last minute's arrivals, maybe still in flight
    judged = np.where(np.isnan(met), 0.0, trace.arrivals)
    within_slo = binned((np.nan_to_num(met) * judged).sum(axis=1), "sum")
    total = binned(judged.sum(axis=1), "sum")
    share = np.divide(within_slo, total, out=np.full(bins, np.nan), where=total > 0)
    within.plot(hours, share, color="tab:green",
                label=f"requests within TTFT {workload.ttft_slo_s:g} s and ITL "
                      f"{workload.itl_slo_s * 1000:g} ms")
    within.set_ylim(-0.05, 1.05)
    within.set_ylabel("within SLO")

    gpu_hours = np.cumsum(trace.replicas.sum(axis=1)) * trace.gpus_per_replica * trace.tick_s / 3600
    gpus.plot(hours, binned(gpu_hours, "max"), color="tab:brown",
              label=f"GPU-hours so far ({trace.gpus_per_replica} GPU(s) per replica)")
    gpus.set_ylabel("GPU-hours")
    gpus.set_xlabel("hours")
    for panel in (load, pools, latency, within, gpus):
        panel.legend(loc="best", fontsize="small")
    fig.tight_layout()
    return fig
