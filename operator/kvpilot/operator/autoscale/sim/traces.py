"""Request-rate traces: the load shapes the simulator replays, as multipliers of a peak rate."""

from __future__ import annotations

import numpy as np

DAY_S = 86_400.0
TRACES = ("diurnal", "bursty", "step", "steady")


def profile(kind: str, ticks: int, tick_s: float, rng: np.random.Generator,
            step_at_s: float = 600.0) -> np.ndarray:
    """Gives the load multiplier (0..1 of the peak) at each tick of a trace.

    diurnal: a day from a 20% trough at midnight to the peak at noon; bursty:
    half load with random 2x bursts of 1-5 minutes; step: a quarter of the peak
    until `step_at_s`, then the peak (a 4x step); steady: half load with 15%
    log-normal noise re-drawn every 10 s.
    """
    t = np.arange(ticks) * tick_s
    if kind == "diurnal":
        return 0.6 - 0.4 * np.cos(2 * np.pi * t / DAY_S)
    if kind == "step":
        return np.where(t < step_at_s, 0.25, 1.0)
    if kind == "steady":
        return 0.5 * _held_noise(t, 10.0, 0.15, rng)
    if kind == "bursty":
        out = np.full(ticks, 0.5)
        start = 0.0
        while True:
            start += rng.exponential(900.0)
            if start >= t[-1]:
                break
            length = rng.uniform(60.0, 300.0)
            out[(t >= start) & (t < start + length)] = 1.0
        return out * _held_noise(t, 10.0, 0.05, rng)
    raise ValueError(f"trace={kind!r} is invalid: choose one of {', '.join(TRACES)}")


def _held_noise(t: np.ndarray, hold_s: float, sigma: float,
                rng: np.random.Generator) -> np.ndarray:
    """Gives mean-one log-normal noise that holds each draw for `hold_s`."""
    slots = (t // hold_s).astype(np.int64)
    draws = rng.lognormal(-sigma * sigma / 2, sigma, size=int(slots[-1]) + 1)
    # Clipped at 3 sigma so a trace's range is known (and testable).
    return np.clip(draws, np.exp(-3 * sigma), np.exp(3 * sigma))[slots]
