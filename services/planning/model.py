"""The deployment performance model: given a profile (profile_file.py) and a workload, predict what a deployment of
prefill and decode (or mixed) workers serves under TTFT/TPOT SLOs, and rank the deployments a budget of cores (or
GPUs) allows. Pure: no torch, no I/O, no clock; the same inputs give the same answer (the workload's seed).

    model = PerformanceModel(profile)                       # a Profile, or its JSON dict
    requests = workload.requests(n=600, seed=0)             # workload.py (or SimRequests of a recorded run)
    p = model.predict(Deployment.disaggregated("1", 1, "1", 1), requests, Slos(ttft_s=1.0, tpot_s=0.05))
    p.goodput, p.attainment, p.ttft_p90_s, p.tpot_p50_s     # req/s meeting both SLOs, share meeting both, ...
    answer = model.plan(workload, slos, budget=8)           # every deployment within 8 units, ranked
    answer.recommended, answer.fewest_units, answer.best_colocated, answer.alternatives
    model.max_rate(deployment, workload, slos, target=0.9)  # the highest rate it serves at 90% attainment

Goodput is as `pdserve bench` defines it: requests meeting every SLO per second of the run, from its start (the
first arrival's clock, 0) to the last request's end. A prediction simulates the requests through the deployment
(simulate.py) on the profile's step costs (costs.py), the KV transfer's coefficients and the serving plane's time,
with the workers' steps slowed by the plane's CPU where it shares their cores (cpu_share.py).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

import numpy as np

from services.planning.costs import WorkerCosts
from services.planning.cpu_share import plane_cores, step_slowdown
from services.planning.profile_file import Profile, profile_from_dict
from services.planning.simulate import Outcome, Pool, Role, SimRequest, Simulation
from services.planning.workload import Workload

TIE = 0.01  # deployments within 1% of the best goodput count as equal: the one with fewest units is recommended
MIN_REQUESTS, MAX_REQUESTS, RUN_S = 400, 3000, 300.0  # a plan simulates about RUN_S seconds of arrivals
PLANE_CPU = ("shared", "separate")  # where the serving plane computes: on the budget's cores, or beside them


@dataclass(frozen=True)
class Slos:
    ttft_s: float
    tpot_s: float

    def __post_init__(self) -> None:
        if not (self.ttft_s > 0 and self.tpot_s > 0):
            raise ValueError("the TTFT and TPOT SLOs must be positive")


@dataclass(frozen=True)
class Deployment:
    """Workers by role: (config name, count). Either mixed workers alone (colocated) or prefill and decode."""

    prefill: tuple[str, int] | None = None
    decode: tuple[str, int] | None = None
    mixed: tuple[str, int] | None = None

    def __post_init__(self) -> None:
        pools = [p for p in (self.prefill, self.decode, self.mixed) if p is not None]
        if any(count < 1 for _, count in pools):
            raise ValueError("a deployment's worker counts must be at least 1")
        disaggregated = self.prefill is not None and self.decode is not None and self.mixed is None
        colocated = self.mixed is not None and self.prefill is None and self.decode is None
        if not (disaggregated or colocated):
            raise ValueError("a deployment is mixed workers alone, or prefill and decode workers")

    @classmethod
    def disaggregated(cls, prefill: str, n_prefill: int, decode: str, n_decode: int) -> Deployment:
        return cls(prefill=(prefill, n_prefill), decode=(decode, n_decode))

    @classmethod
    def colocated(cls, mixed: str, n_mixed: int) -> Deployment:
        return cls(mixed=(mixed, n_mixed))

    @property
    def kind(self) -> str:
        return "colocated" if self.mixed is not None else "disaggregated"

    def pools(self) -> list[tuple[Role, str, int]]:
        out = [(Role.PREFILL, self.prefill), (Role.DECODE, self.decode), (Role.MIXED, self.mixed)]
        return [(role, p[0], p[1]) for role, p in out if p is not None]

    @property
    def name(self) -> str:
        """ "2 prefill [1] + 1 decode [2]": counts, roles and each worker's config in brackets."""
        return " + ".join(f"{n} {role} [{cfg}]" for role, cfg, n in self.pools())

    def units(self, unit_of: dict[str, int]) -> int:
        return sum(n * unit_of[cfg] for _, cfg, n in self.pools())

    def to_json(self) -> dict:
        return {role.value: {"config": cfg, "workers": n} for role, cfg, n in self.pools()}


@dataclass(frozen=True)
class Prediction:
    deployment: Deployment
    units: int
    requests: int
    goodput: float  # req/s meeting both SLOs, over the run
    attainment: float  # share of the requests meeting both
    ttft_attainment: float
    tpot_attainment: float
    throughput: float  # req/s completed over the run
    duration_s: float  # the run: 0 to the last request's end
    ttft_p50_s: float
    ttft_p90_s: float
    tpot_p50_s: float
    tpot_p90_s: float

    def to_json(self) -> dict:
        out = asdict(self)
        out["deployment"] = self.deployment.to_json()
        out["name"] = self.deployment.name
        out["kind"] = self.deployment.kind
        return out


@dataclass(frozen=True)
class Plan:
    """`plan`'s answer: every deployment within the budget, ranked (best goodput first; at equal goodput, fewer
    units), the recommendation, and the best of each kind."""

    recommended: Prediction
    alternatives: tuple[Prediction, ...]  # ranked; the recommendation among them
    fewest_units: Prediction | None  # the smallest deployment reaching the attainment target (None: none does)
    best_colocated: Prediction | None
    best_disaggregated: Prediction | None
    budget: int
    unit: str  # cores | gpus
    attainment_target: float
    slos: Slos
    workload: dict  # Workload.summary()
    requests: int
    seed: int
    max_rate: float | None = None  # of the recommendation, at the attainment target
    plane_cores: float | None = None  # the serving plane's CPU on the budget's cores at this rate (None: separate)

    @property
    def colocated_better(self) -> bool | None:
        """Whether the best colocated deployment predicts more goodput than the best disaggregated one (None when
        one kind has no candidate)."""
        if self.best_colocated is None or self.best_disaggregated is None:
            return None
        return self.best_colocated.goodput > self.best_disaggregated.goodput * (1 + TIE)

    def to_json(self) -> dict:
        return {
            "recommended": self.recommended.to_json(),
            "fewest_units": self.fewest_units.to_json() if self.fewest_units else None,
            "best_colocated": self.best_colocated.to_json() if self.best_colocated else None,
            "best_disaggregated": self.best_disaggregated.to_json() if self.best_disaggregated else None,
            "colocated_better": self.colocated_better,
            "max_rate": self.max_rate,
            "plane_cores": self.plane_cores,
            "alternatives": [p.to_json() for p in self.alternatives],
            "budget": self.budget,
            "unit": self.unit,
            "attainment_target": self.attainment_target,
            "slos": {"ttft_ms": self.slos.ttft_s * 1e3, "tpot_ms": self.slos.tpot_s * 1e3},
            "workload": self.workload,
            "simulated_requests": self.requests,
            "seed": self.seed,
        }


def run_length(rate: float) -> int:
    """Requests a plan simulates: about RUN_S seconds of arrivals, within [MIN_REQUESTS, MAX_REQUESTS]."""
    return int(min(max(rate * RUN_S, MIN_REQUESTS), MAX_REQUESTS))


class PerformanceModel:
    """The model over one profile (see the module). `plane_cpu`: "shared" when the serving plane (gateway, NATS,
    Redis) runs on the budget's cores, as on one host (`pdserve up`), "separate" when it has cores of its own; with
    `client_cpu`, the load's client shares them too (a benchmark on the same host). A GPU profile's plane is never
    on its units (GPUs)."""

    def __init__(self, profile: Profile | dict, plane_cpu: str = "shared", client_cpu: bool = False) -> None:
        if plane_cpu not in PLANE_CPU:
            raise ValueError(f"plane_cpu is one of {', '.join(PLANE_CPU)}, got {plane_cpu!r}")
        self.profile = profile if isinstance(profile, Profile) else profile_from_dict(profile)
        budget = self.profile.engine.max_num_batched_tokens
        self.costs = {c.config.name: WorkerCosts.of(c, budget) for c in self.profile.configs}
        self.unit_of = {name: c.units for name, c in self.costs.items()}
        self.plane_shares = plane_cpu == "shared" and self.profile.unit == "cores"
        self.client_cpu = client_cpu

    # ---- one deployment ---------------------------------------------------------------------------------------

    def simulate(
        self, deployment: Deployment, requests: Sequence[SimRequest], shared_cores: int | None = None
    ) -> list[Outcome]:
        """Each request's outcome on `deployment`; the plane (when it shares cores) runs on `shared_cores` cores,
        by default the deployment's own. With a plane there, the requests are simulated twice: at the profile's
        speed, which says how many cores the workers keep busy, then with the slowdown the plane's excess over
        the idle ones gives (cpu_share.py)."""
        p = self.profile

        def run(slowdown: float) -> Simulation:
            pools = [Pool(role, self._costs(cfg), n, slowdown) for role, cfg, n in deployment.pools()]
            sim = Simulation(requests, pools, p.engine, p.transfer, p.plane)
            sim.run()
            return sim

        sim = run(1.0)
        plane = self.plane_cores(requests) if self.plane_shares else 0.0
        if plane > 0:
            shared = deployment.units(self.unit_of) if shared_cores is None else shared_cores
            slowdown = step_slowdown(sim.busy_cores(), shared, plane)
            if slowdown > 1.0:
                sim = run(slowdown)
        return sim.outcomes

    def plane_cores(self, requests: Sequence[SimRequest]) -> float:
        """The cores the plane (and the client, with client_cpu) spends on `requests` (cpu_share.py)."""
        pl = self.profile.plane
        per_request, per_token = pl.cpu_s_per_request, pl.cpu_s_per_token
        if self.client_cpu:
            per_request, per_token = per_request + pl.client_cpu_s_per_request, per_token + pl.client_cpu_s_per_token
        return plane_cores(requests, per_request, per_token)

    def predict(
        self, deployment: Deployment, requests: Sequence[SimRequest], slos: Slos, shared_cores: int | None = None
    ) -> Prediction:
        """Goodput, attainment and TTFT/TPOT percentiles of `deployment` serving `requests`."""
        if not requests:
            raise ValueError("no requests to predict")
        outcomes = self.simulate(deployment, requests, shared_cores)
        return summarize(deployment, deployment.units(self.unit_of), requests, outcomes, slos)

    def max_rate(
        self,
        deployment: Deployment,
        workload: Workload,
        slos: Slos,
        target: float = 0.9,
        seed: int = 0,
        shared_cores: int | None = None,
    ) -> float:
        """The highest rate (req/s, to about 2%) at which `deployment` meets both SLOs for `target` of the
        requests; 0 when not even a trickle does (the SLOs are below its unloaded latency)."""

        def ok(rate: float) -> bool:
            wl = workload.with_rate(rate)
            reqs = wl.requests(run_length(rate), seed)
            return self.predict(deployment, reqs, slos, shared_cores).attainment >= target

        start = max(workload.rate, 0.1)
        if ok(start):  # double until it fails
            lo, hi = start, 2 * start
            while ok(hi):
                lo, hi = hi, 2 * hi
                if hi > 1e6:
                    return math.inf
        else:  # halve until it holds
            lo, hi = start / 2, start
            while not ok(lo):
                lo, hi = lo / 2, lo
                if lo < start / 1024:
                    return 0.0
        while hi - lo > 0.02 * hi:
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo

    # ---- many deployments -------------------------------------------------------------------------------------

    def deployments(self, budget: int, configs: Sequence[str] | None = None) -> Iterator[Deployment]:
        """Every deployment whose workers take at most `budget` units: prefill and decode workers (one config per
        role) or mixed workers (one config), each role at least one worker."""
        names = list(configs or self.costs)
        for m in names:
            for n in range(1, budget // self.unit_of[m] + 1):
                yield Deployment.colocated(m, n)
        for p in names:
            for d in names:
                up, ud = self.unit_of[p], self.unit_of[d]
                for n_p in range(1, (budget - ud) // up + 1):
                    for n_d in range(1, (budget - n_p * up) // ud + 1):
                        yield Deployment.disaggregated(p, n_p, d, n_d)

    def plan(
        self,
        workload: Workload,
        slos: Slos,
        budget: int,
        attainment: float = 0.9,
        requests: int | None = None,
        seed: int = 0,
        configs: Sequence[str] | None = None,
        with_max_rate: bool = True,
    ) -> Plan:
        """Every deployment within `budget` units on the same seeded requests, ranked; see Plan."""
        if budget < 1:
            raise ValueError(f"the budget must be at least 1 {self.profile.unit}, got {budget}")
        n = requests or run_length(workload.rate)
        reqs = workload.requests(n, seed)
        preds = [self.predict(d, reqs, slos, budget) for d in self.deployments(budget, configs)]
        if not preds:
            raise ValueError(f"no deployment fits {budget} {self.profile.unit} (the smallest config takes "
                             f"{min(self.unit_of.values())})")  # fmt: skip
        ranked = sorted(preds, key=lambda p: (-p.goodput, p.units, p.deployment.name))
        best = ranked[0].goodput
        near = (p for p in ranked if p.goodput >= best * (1 - TIE))
        recommended = min(near, key=lambda p: (p.units, -p.goodput, p.deployment.name))
        meeting = [p for p in preds if p.attainment >= attainment]
        fewest = min(meeting, key=lambda p: (p.units, -p.goodput, p.deployment.name)) if meeting else None

        def best_of(kind: str) -> Prediction | None:
            return next((p for p in ranked if p.deployment.kind == kind), None)

        rate = None
        if with_max_rate:
            rate = self.max_rate(recommended.deployment, workload, slos, attainment, seed, budget)
        return Plan(recommended, tuple(ranked), fewest, best_of("colocated"), best_of("disaggregated"), budget,
                    self.profile.unit, attainment, slos, workload.summary(), n, seed, rate,
                    self.plane_cores(reqs) if self.plane_shares else None)  # fmt: skip

    def _costs(self, name: str) -> WorkerCosts:
        if name not in self.costs:
            raise ValueError(f"the profile has no config {name!r} (it has {', '.join(self.costs)})")
        return self.costs[name]


def summarize(
    deployment: Deployment, units: int, requests: Sequence[SimRequest], outcomes: Sequence[Outcome], slos: Slos
) -> Prediction:
    """A Prediction from simulated outcomes: goodput over the run from 0 to the last end, as the bench counts it;
    TPOT percentiles over the requests of more than one output token (a single token's TPOT is 0: it passes)."""
    ttft = np.array([o.ttft_s for o in outcomes])
    tpot = np.array([o.tpot_s for o in outcomes])
    several = np.array([r.output_len > 1 for r in requests])
    tpots = tpot[several] if several.any() else np.zeros(1)
    duration = max(o.finish_s for o in outcomes)
    ttft_ok, tpot_ok = ttft <= slos.ttft_s, tpot <= slos.tpot_s
    good = int(np.sum(ttft_ok & tpot_ok))
    n = len(outcomes)
    return Prediction(
        deployment=deployment,
        units=units,
        requests=n,
        goodput=good / duration,
        attainment=good / n,
        ttft_attainment=float(np.mean(ttft_ok)),
        tpot_attainment=float(np.mean(tpot_ok)),
        throughput=n / duration,
        duration_s=duration,
        ttft_p50_s=float(np.percentile(ttft, 50)),
        ttft_p90_s=float(np.percentile(ttft, 90)),
        tpot_p50_s=float(np.percentile(tpots, 50)),
        tpot_p90_s=float(np.percentile(tpots, 90)),
    )


def predict(profile: Profile | dict, deployment: Deployment, requests: Sequence[SimRequest], slos: Slos) -> Prediction:
    """PerformanceModel(profile).predict(...): one deployment, one list of requests."""
    return PerformanceModel(profile).predict(deployment, requests, slos)
