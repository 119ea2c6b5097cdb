"""Where the services of a local stack run, when not all on this machine's loopback: the seam through which a
stack is spread over separate network hosts (StackSpec.hosts).

A stack names its services "nats", "redis", "gateway" and its workers "<role>-<i>" (prefill-0, decode-1, ...).
For each, a `ServiceHosts` says the address it binds on its host — the one every other service reaches it at,
and a worker's KV transfer server advertises to decode workers —, the command prefix that starts a program
on that host (e.g. `ip netns exec NS`), and a port free there. The stack then starts everything as it always
does (same flags, same environment, same supervision), each child under its host's prefix, told only those
addresses: what runs across hosts is what runs on one.

Without one (StackSpec.hosts None) a stack is on this machine: infra on 127.0.0.1, the gateway and the
workers' /metrics on spec.host, the workers' KV transfer servers on their own setting (127.0.0.1 unless
PDSERVE_RPC_HOST says otherwise). The tests' emulated hosts (network namespaces joined by a bridge) implement
it: benchmarks/link_emulation.py, `HostNetwork.placement`.
"""

from __future__ import annotations

from typing import Protocol

INFRA = ("nats", "redis")


class ServiceHosts(Protocol):
    def address(self, service: str) -> str:
        """The address `service` binds on its host, at which the others (and this process) reach it."""
        ...

    def prefix(self, service: str) -> list[str]:
        """The argv prefix that runs a command on `service`'s host ([] = here)."""
        ...

    def port(self, service: str) -> int:
        """A port free at `service`'s address on its host (infra servers, a worker's /metrics)."""
        ...
