"""The fleet simulator: control events on a heap over a fixed-step fluid model of the pools.

Each model has a prefill pool and a decode pool. Arrivals are Poisson counts per
tick; prefill is a fluid queue of prompt tokens served at the cost model's rate
(with the M/M/1 queue and sojourn a real engine shows below saturation); decode
admits prefilled requests into KV/sequence slots and drains them at one token per
step of the cost model. Every tick updates all models at once with numpy. On the
heap sit the autoscaler's timers (one per pool, staggered) and pod start-ups; each
timer runs the real `policy.decide` (and `budget.allocate` when a GPU budget is
set) on metrics derived from the pool's state.
"""

from __future__ import annotations

import heapq
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from kvpilot.operator.autoscale.budget import PoolDemand, allocate
from kvpilot.operator.autoscale.policy import PolicyState, decide
from kvpilot.operator.autoscale.signals import PoolMetrics
from kvpilot.operator.autoscale.sim.calibration import CostModel
from kvpilot.operator.autoscale.sim.calibration import load as load_calibration
from kvpilot.operator.autoscale.sim.dataplane import DECODE, PREFILL, DataPlane
from kvpilot.operator.autoscale.sim.traces import profile
from kvpilot.operator.autoscale.spec import PolicySpec, role_targets

ROLES = ("prefill", "decode")


@dataclass(frozen=True)
class Workload:
    """Request shape and the SLO each request is judged by."""

    prompt_tokens: float = 1000.0
    output_tokens: float = 200.0
    ttft_slo_s: float = 2.0
    itl_slo_s: float = 0.05


def aggregated_specs(max_replicas: int = 10_000) -> tuple[PolicySpec, PolicySpec]:
    """Gives the specs of an aggregated run: an unused prefill spec and a "both" pool."""
    return default_spec("prefill", max_replicas), default_spec("both", max_replicas)


def default_spec(role: str, max_replicas: int = 10_000) -> PolicySpec:
    """Gives the policy the simulator runs when none is given (the CRD's defaults)."""
    return PolicySpec(role=role, min_replicas=1, max_replicas=max_replicas,
                      targets=role_targets(role))


@dataclass
class SimConfig:
    """One simulation run."""

    trace: str = "diurnal"
    duration_s: float = 86_400.0
    tick_s: float = 1.0
    models: int = 1
    peak_rps: float = 200.0
    """Peak request rate of the whole fleet, split log-normally over the models."""
    seed: int = 0
    step_at_s: float = 600.0
    workload: Workload = field(default_factory=Workload)
    cost: CostModel = field(default_factory=load_calibration)
    specs: tuple[PolicySpec, PolicySpec] = field(
        default_factory=lambda: (default_spec("prefill"), default_spec("decode")))
    gpu_budget: int | None = None
    """GPUs each model's two pools may hold together (None: unlimited)."""
    aggregated: bool = False
    """One pool of role "both" per model (specs[1] then should be a "both" spec);
    the prefill pool stays at zero replicas."""
    static_replicas: tuple[np.ndarray, np.ndarray] | None = None
    """Fixed replicas per model and pool: no autoscaler (the static baseline)."""


@dataclass
class SimTrace:
    """What the run recorded: per-tick arrays and the scale events."""

    tick_s: float
    arrivals: np.ndarray          # (T, M) requests arriving in each tick
    admitted_cum: np.ndarray      # (T, M) requests admitted to decode by each tick's end
    prefill_sojourn_s: np.ndarray  # (T, M) mean prefill queueing plus service time
    itl_s: np.ndarray             # (T, M) decode step time
    replicas: np.ndarray          # (T, 2) total spec replicas per role (GPUs allocated)
    ready: np.ndarray             # (T, 2) total ready replicas per role
    events: list[tuple[float, int, int, int, int, str]] = field(default_factory=list)
    """(time, model, pool, from, to, signal) of every replica change."""
    gpus_per_replica: int = 1
    peak_rps_per_model: np.ndarray | None = None
    """(M,) each model's peak request rate (its share of the fleet's)."""
    aggregated: bool = False
    """One pool of role "both" per model (in the decode column; prefill stays empty)."""

    def pools(self) -> list[tuple[str, int]]:
        """Gives (role, column of `replicas`/`ready`) of each pool the run had."""
        return [("both", DECODE)] if self.aggregated else [(r, i) for i, r in enumerate(ROLES)]


def initial_replicas(rate: np.ndarray, cfg: SimConfig) -> tuple[np.ndarray, np.ndarray]:
    """Gives replicas that carry `rate` (requests/s per model) at the policy's targets."""
    w, cost = cfg.workload, cfg.cost
    rho = 0.8
    prefill = np.ceil(rate * w.prompt_tokens / (cost.prefill_tokens_per_s * rho))
    running = cfg.specs[DECODE].targets.get("runningRequestsPerReplica", 96.0)
    step = cost.decode_step_s(running, w.prompt_tokens + w.output_tokens / 2)
    decode = np.ceil(rate * w.output_tokens * step / running)
    if cfg.aggregated:
        # One pool does both: the prefill share of its time stretches every decode step.
        both = np.ceil(rate * w.output_tokens * step / running
                       + rate * w.prompt_tokens / (cost.prefill_tokens_per_s * rho))
        return np.zeros_like(both, dtype=np.int64), np.maximum(both, 1).astype(np.int64)
    return np.maximum(prefill, 1).astype(np.int64), np.maximum(decode, 1).astype(np.int64)


def static_for_peak(trace: SimTrace, cfg: SimConfig) -> tuple[np.ndarray, np.ndarray]:
    """Gives the static baseline: each pool sized at the policy's targets for its peak load."""
    assert trace.peak_rps_per_model is not None
    return initial_replicas(trace.peak_rps_per_model, cfg)


def simulate(cfg: SimConfig) -> SimTrace:
    """Gives the recorded run of `cfg` (deterministic for a given seed)."""
    return _Run(cfg).run()


class _Run:
    def __init__(self, cfg: SimConfig) -> None:
        self.cfg = cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.ticks = round(cfg.duration_s / cfg.tick_s)
        m = cfg.models
        shares = self.rng.lognormal(0.0, 0.5, size=m)
        self.peak_rps = cfg.peak_rps * shares / shares.sum()
        shape = profile(cfg.trace, self.ticks, cfg.tick_s, self.rng, cfg.step_at_s)
        self.rate = shape[:, None] * self.peak_rps[None, :]
        self.arrivals = self.rng.poisson(self.rate * cfg.tick_s).astype(np.float64)
        if cfg.static_replicas is not None:
            start = tuple(np.asarray(r, dtype=np.int64) for r in cfg.static_replicas)
        else:
            start = initial_replicas(self.rate[0], cfg)
        self.spec_r = np.stack(start).astype(np.int64)          # (2, M)
        self.ready = self.spec_r.astype(np.float64).copy()
        self.plane = DataPlane(cfg.cost, cfg.workload.prompt_tokens, cfg.workload.output_tokens,
                               self.rate[0], self.ready[DECODE if cfg.aggregated else PREFILL],
                               cfg.aggregated)
        self.states = [[PolicyState() for _ in range(m)] for _ in ROLES]
        # Samples older than the policy's metrics window are never read: keep no more.
        keep = [int(s.metrics_window_seconds // s.interval_seconds) + 2 for s in cfg.specs]
        self.history: list[list[deque[PoolMetrics]]] = [
            [deque(maxlen=keep[p]) for _ in range(m)] for p in range(len(ROLES))]
        self.votes = np.ones((2, m))     # load/target of each pool's winning signal
        self.pending: list[list[deque[int]]] = [[deque() for _ in range(m)] for _ in ROLES]
        self.cancelled: set[int] = set()
        self.heap: list[tuple[float, int, str, int, int]] = []
        self.seq = 0
        self.events: list[tuple[float, int, int, int, int, str]] = []
        if cfg.static_replicas is None:
            for pool, spec in enumerate(cfg.specs):
                if cfg.aggregated and pool == PREFILL:
                    continue
                offsets = self.rng.uniform(0, spec.interval_seconds, size=m)
                for i in range(m):
                    self._push(float(offsets[i]), "decide", pool, i)

    def _push(self, time: float, kind: str, pool: int, model: int) -> int:
        self.seq += 1
        heapq.heappush(self.heap, (time, self.seq, kind, pool, model))
        return self.seq

    def run(self) -> SimTrace:
        cfg, t_count, m = self.cfg, self.ticks, self.cfg.models
        admitted_cum = np.empty((t_count, m))
        sojourn_rec = np.empty((t_count, m))
        itl_rec = np.empty((t_count, m))
        replicas = np.empty((t_count, 2), dtype=np.int64)
        ready = np.empty((t_count, 2))
        admitted = np.zeros(m)
        for i in range(t_count):
            now = i * cfg.tick_s
            while self.heap and self.heap[0][0] <= now:
                time, seq, kind, pool, model = heapq.heappop(self.heap)
                if kind == "ready":
                    if seq in self.cancelled:
                        self.cancelled.discard(seq)
                    else:
                        self.pending[pool][model].popleft()
                        self.ready[pool, model] += 1
                else:
                    self._decide(time, pool, model)
            admitted += self.plane.step(self.arrivals[i], self.ready, cfg.tick_s)
            admitted_cum[i] = admitted
            sojourn_rec[i] = self.plane.sojourn_s()
            itl_rec[i] = self.plane.itl
            replicas[i] = self.spec_r.sum(axis=1)
            ready[i] = self.ready.sum(axis=1)
        return SimTrace(cfg.tick_s, self.arrivals, admitted_cum, sojourn_rec, itl_rec, replicas,
                        ready, self.events, cfg.cost.gpus_per_replica, self.peak_rps,
                        cfg.aggregated)

    def _decide(self, now: float, pool: int, model: int) -> None:
        spec = self.cfg.specs[pool]
        self._push(now + spec.interval_seconds, "decide", pool, model)
        current = int(self.spec_r[pool, model])
        history = self.history[pool][model]
        history.append(self.plane.metrics(pool, model, int(self.ready[pool, model]), now))
        d = decide(spec, self.states[pool][model], history, current, now)
        self.states[pool][model] = d.state
        desired = d.desired
        if d.vote is not None:
            self.votes[pool, model] = d.vote.replicas / max(current, 1)
        if self.cfg.gpu_budget is not None:
            desired = self._budget(pool, model, desired)
        if desired != current:
            self._apply(now, pool, model, desired)
            signal = d.vote.signal if d.vote else ""
            self.events.append((now, model, pool, current, desired, signal))

    def _budget(self, pool: int, model: int, desired: int) -> int:
        """Gives `desired` cut to this pool's share of the model's GPU budget."""
        gpus = self.cfg.cost.gpus_per_replica
        demands = []
        for p, spec in enumerate(self.cfg.specs):
            if self.cfg.aggregated and p == PREFILL:
                continue
            current = int(self.spec_r[p, model])
            want = desired if p == pool else current
            demands.append(PoolDemand(ROLES[p], current=current, desired=want,
                                      min_replicas=spec.min_replicas, gpus_per_replica=gpus,
                                      load=float(self.votes[p, model]) * max(current, 1)))
        grant = allocate(self.cfg.gpu_budget or 0, demands)
        return grant.replicas[ROLES[pool]]

    def _apply(self, now: float, pool: int, model: int, desired: int) -> None:
        current = int(self.spec_r[pool, model])
        queue = self.pending[pool][model]
        if desired > current:
            for _ in range(desired - current):
                queue.append(self._push(now + self.cfg.cost.startup_s, "ready", pool, model))
        else:
            # Kubernetes removes pods that are not ready yet first.
            for _ in range(current - desired):
                if queue:
                    self.cancelled.add(queue.pop())
                else:
                    self.ready[pool, model] -= 1
        self.spec_r[pool, model] = desired
