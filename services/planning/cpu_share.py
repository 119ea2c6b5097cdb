"""The serving plane's CPU on the workers' cores: how much slower a worker steps when the gateway, NATS and Redis
(and a load client on the same host) compute on the cores it computes on.

On one host (`pdserve up`, or a node that runs the plane beside its workers) nothing keeps the plane off the
workers' cores. Its CPU scales with the traffic: per request (HTTP, tokenizing, the job's publish) and per output
token (a token event through NATS, an SSE chunk): `PlaneCosts.cpu_s_per_request/_per_token`, which
`pdserve profile --serving-plane` measures from the processes' CPU time over its probes (plane.py).

The model: the plane needs P = rate · (per_request + mean output · per_token) cores. It takes idle cores of the
shared ones first: a deployment of U busy cores in a budget of C shared cores leaves C - U free. The rest,
E = max(P - (C - U), 0), preempts the workers, spread evenly: each busy core loses s = E / U of its time. A worker
of k threads steps at 1 / (1 - k·s) of its profiled speed: its threads meet at a barrier after every parallel
region (a layer's kernels take tens to hundreds of µs, a plane burst as long), so a burst on any one of its cores
stalls all of them; a one-thread worker loses only its own core's share. Checked on the 2-core hosts
(docs/planning.md): a 2-thread engine under a burner of 0.2 cores stepped 1.12-1.25x slower (1 / (1 - 2 · 0.1) =
1.25), and a 2-thread mixed worker's decode steps in a stack whose plane took 0.18 cores 1.2-1.4x its profile.

Every busy core is taken as busy all the time, the regime where SLOs are at stake; a lightly loaded worker leaves
its core to the plane and steps at about its profiled speed, which the model does not credit.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

MAX_STOLEN = 0.8  # a step slows at most 5x: past that the deployment is the plane's, not the workers'


class _Request(Protocol):
    arrival_s: float
    output_len: int


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


def step_slowdown(threads: int, busy_cores: int, shared_cores: int, plane: float) -> float:
    """A worker of `threads` threads, in a deployment of `busy_cores` cores among `shared_cores` the plane also runs
    on, with the plane needing `plane` cores: its step time over its profiled one (see the module)."""
    if threads < 1 or busy_cores < 1:
        raise ValueError("a worker has at least one thread, a deployment at least one core")
    excess = plane - max(shared_cores - busy_cores, 0)
    if excess <= 0:
        return 1.0
    stolen = min(threads * excess / busy_cores, MAX_STOLEN)
    return 1.0 / (1.0 - stolen)
