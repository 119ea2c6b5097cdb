"""The serving plane's CPU on the workers' cores: how much slower a worker steps when the gateway, NATS and Redis
(and a load client on the same host) run on the cores it computes on.

On one host (`pdserve up`, or a node that runs the plane beside its workers) nothing keeps the plane off the
workers' cores. Its CPU scales with the traffic: per request (HTTP, tokenizing, the job's publish) and per output
token (a token event through NATS, an SSE chunk): `PlaneCosts.cpu_s_per_request/_per_token`, which
`pdserve profile --serving-plane` measures from the processes' CPU time over its probes (plane.py).

The model: the plane needs P = rate · (per_request + mean output · per_token) cores. It takes idle cores first:
the requests simulated at the profile's speed keep B cores of the C shared ones busy on average (a worker of U
units counts U while it steps), leaving C - B idle. The rest, E = max(P - (C - B), 0), preempts the workers,
spread evenly: each busy core loses s = E / B of its time, and every step of every worker costs 1 / (1 - s) of
its profiled time, whatever its thread count; the requests are simulated again at that speed (model.simulate).

Why not more for a worker of several threads, whose threads meet at a barrier after every parallel region, so that a
burst of the plane on any one of its cores stalls all of them (1 / (1 - k·s) for k threads)? Its steps do show some
of that: on the 2-core Intel host a 2-thread engine under a burner of 0.2 cores stepped 1.12-1.36x slower
(benchmarks/plane_burner.py), and a 2-thread mixed worker's decode steps in a stack whose plane took 0.18 cores
1.14-1.38x its profile (benchmarks/stack_steps.py). But end to end, charging k·s over-predicted that worker's TPOT
p50 and p90 by 1.34-1.43x in the run that tried it, and a barrier-aware share (every burst that lands on any of its
cores while it steps stalls it, after the idle cores) by 1.30-1.78x in four runs of six, while the share alone
brought the TPOT p50 of 21 split-runs (three splits, seven plan checks, each on a fresh profile) from a geometric
mean of 0.88x the measured without a plane term to 0.99x, its mean |log error| from 0.17 to 0.16
(docs/benchmarks.md, "Deployment planner"). It takes out a bias, not the scatter of a host whose speed drifts, and
the one check measured in three rounds favoured no term: thin evidence, which is why `--plane-cpu separate` exists.

The idle time is an average over the run: a burst that keeps every core busy for a while loses its share then
too, which the model does not charge, and a worker's idle moments inside a step (a thread at a barrier) are
counted busy.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

MAX_STOLEN = 0.8  # a step slows at most 5x: past that the deployment is the plane's, not the workers'


class _Request(Protocol):
    @property
    def arrival_s(self) -> float: ...
    @property
    def output_len(self) -> int: ...


def plane_cores(requests: Sequence[_Request], per_request_s: float, per_token_s: float) -> float:
    """The cores the plane spends serving `requests` at their arrival rate (0 for fewer than two arrivals)."""
    if len(requests) < 2 or not (per_request_s or per_token_s):
        return 0.0
    times = [r.arrival_s for r in requests]
    span = max(times) - min(times)
    if span <= 0:
        return 0.0
    rate = (len(requests) - 1) / span  # arrivals per second between the first and the last
    mean_output = sum(r.output_len for r in requests) / len(requests)
    return rate * (per_request_s + mean_output * per_token_s)


def step_slowdown(busy_cores: float, shared_cores: int, plane: float) -> float:
    """A worker's step time over its profiled one, when the workers keep `busy_cores` of the `shared_cores` the
    plane also runs on busy and the plane needs `plane` cores (see the module)."""
    if busy_cores <= 0:
        return 1.0  # nothing ran: nothing to slow
    excess = plane - max(shared_cores - busy_cores, 0.0)
    if excess <= 0:
        return 1.0
    return 1.0 / (1.0 - min(excess / busy_cores, MAX_STOLEN))
