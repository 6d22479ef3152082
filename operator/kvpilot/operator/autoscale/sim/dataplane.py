"""The simulator's data plane: every model's pools as fluid queues, one numpy tick at a time.

Disaggregated: a prefill pool serves a FIFO fluid queue of prompt tokens; what it
prefills is admitted into the decode pool's KV/sequence slots. Aggregated: one pool
("both") does both, and the share of its time that prefill takes (ρ) stretches
every decode step by 1 / (1 − ρ), as chunked prefill does in a real engine.
"""

from __future__ import annotations

import math

import numpy as np

from kvpilot.operator.autoscale.signals import PoolMetrics
from kvpilot.operator.autoscale.sim.calibration import CostModel

PREFILL, DECODE = 0, 1
EWMA_S = 10.0  # seconds over which the prefill utilisation metric is averaged
MAX_PREFILL_SHARE = 0.95  # an aggregated replica always keeps some time for decode steps


class DataPlane:
    """Fluid state of every model: prefill backlog and queue, decode waiting and running."""

    def __init__(self, cost: CostModel, prompt_tokens: float, output_tokens: float,
                 rate: np.ndarray, prefill_ready: np.ndarray, aggregated: bool) -> None:
        self.cost, self.lin, self.lout = cost, prompt_tokens, output_tokens
        self.aggregated = aggregated
        m = rate.shape[0]
        self.backlog = np.zeros(m)  # prompt tokens not prefilled yet
        self.rho = rate * prompt_tokens / (np.maximum(prefill_ready, 1)
                                           * cost.prefill_tokens_per_s)
        self.queue = np.zeros(m)  # M/M/1 waiting requests per prefilling replica
        self.waiting_decode = np.zeros(m)
        self.running = rate * output_tokens * cost.decode_step_s(100, prompt_tokens)
        self.running_avg = self.running.copy()
        self.itl = np.full(m, cost.decode_step_base_s)

    def step(self, arrivals: np.ndarray, ready: np.ndarray, dt: float) -> np.ndarray:
        """Advances every model one tick of `dt` seconds; gives the requests admitted to decode."""
        cost = self.cost
        prefillers = ready[DECODE] if self.aggregated else ready[PREFILL]
        capacity = prefillers * cost.prefill_tokens_per_s * dt
        inflow = arrivals * self.lin
        inst = inflow / np.maximum(capacity, 1e-9)
        self.rho += min(dt / EWMA_S, 1.0) * (inst - self.rho)
        # The M/M/1 queue relaxes towards ρ²/(1 − ρ) with time constant
        # S / (1 − √ρ)²: slowly near saturation, so a 10 s burst does not fill it.
        rho = np.minimum(self.rho, 0.99)
        steady = rho * rho / (1 - rho)
        relax = self.lin / cost.prefill_tokens_per_s / (1 - np.sqrt(rho)) ** 2
        self.queue += (steady - self.queue) * (1 - np.exp(-dt / relax))
        served = np.minimum(self.backlog + inflow, capacity)
        self.backlog += inflow - served
        slots = ready[DECODE] * cost.decode_slots(self.lin + self.lout)
        candidates = self.waiting_decode + served / self.lin
        admit = np.minimum(candidates, np.maximum(slots - self.running, 0.0))
        self.waiting_decode = candidates - admit
        self.running += admit
        # Each running request ends at rate 1/τ, τ = output tokens × step time: an
        # exact exponential per tick, and the tick's time-average (which obeys Little's
        # law, R = λτ, at any tick length) is what the pods report.
        has_decode = ready[DECODE] > 0
        batch = self.running_avg / np.maximum(ready[DECODE], 1)
        self.itl = cost.decode_step_s(batch, self.lin + self.lout / 2)
        if self.aggregated:
            share = np.minimum(served / np.maximum(capacity, 1e-9), MAX_PREFILL_SHARE)
            self.itl = self.itl / (1.0 - share)
        x = np.where(has_decode, dt / (self.itl * self.lout), 0.0)
        keep = np.exp(-x)
        self.running_avg = np.where(has_decode, self.running * (1 - keep) / np.maximum(x, 1e-12),
                                    self.running)
        self.running *= keep
        return admit

    def sojourn_s(self) -> np.ndarray:
        """Gives each model's mean prefill queueing plus service seconds now."""
        service = self.lin / self.cost.prefill_tokens_per_s
        return service * (1.0 + self.queue / np.maximum(self.rho, 1e-3))

    def _prefill_view(self, model: int, n: int) -> dict[str, float]:
        rho = min(float(self.rho[model]), 0.99)
        backlog = float(self.backlog[model])
        per_replica = float(self.queue[model])
        queue = n * per_replica + backlog / self.lin
        service = self.lin / self.cost.prefill_tokens_per_s
        sojourn = service * (1 + per_replica / max(rho, 1e-3))
        return {"rho": rho, "queue": queue, "tokens": (queue + n * rho) * self.lin,
                "ttft": sojourn * math.log(10) + backlog / max(
                    n * self.cost.prefill_tokens_per_s, 1e-9)}

    def metrics(self, pool: int, model: int, n: int, now: float) -> PoolMetrics:
        """Gives what the pool's n ready pods would report now."""
        cap = max(n * self.cost.kv_capacity_tokens, 1)
        running = float(self.running_avg[model])
        kv_decode = running * (self.lin + self.lout / 2)
        if pool == PREFILL or self.aggregated:
            p = self._prefill_view(model, n)
            prefilling = n * p["rho"]
            if pool == PREFILL:
                return PoolMetrics(
                    time=now, replicas_reporting=n,
                    kv_cache_utilization=prefilling * self.lin / cap,
                    requests_waiting=p["queue"], requests_running=prefilling,
                    waiting_prompt_tokens=p["tokens"], ttft_p90_seconds=p["ttft"])
            return PoolMetrics(
                time=now, replicas_reporting=n,
                kv_cache_utilization=(kv_decode + prefilling * self.lin) / cap,
                requests_waiting=p["queue"] + float(self.waiting_decode[model]),
                requests_running=running + prefilling, waiting_prompt_tokens=p["tokens"],
                ttft_p90_seconds=p["ttft"], itl_p90_seconds=float(self.itl[model]))
        return PoolMetrics(
            time=now, replicas_reporting=n, kv_cache_utilization=kv_decode / cap,
            requests_waiting=float(self.waiting_decode[model]), requests_running=running,
            waiting_prompt_tokens=0.0, itl_p90_seconds=float(self.itl[model]))
