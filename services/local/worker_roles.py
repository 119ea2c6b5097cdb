"""The role each of `pdserve up`'s workers serves now, as the supervisor learns it: a worker may switch role while it
runs (the admin API, the planner: shared/worker/host.py), and a restart — after it died, or in a rolling restart —
must bring it back in the role it had then, not the one it was launched with, or the planner's decision is undone.

The source is the worker's own `pdserve:worker_role{role}` gauge on the /metrics port the stack gave it (1 for the
role it serves, set once the new role takes jobs). Of what the stack knows, it is the least fragile:
  - it is the worker's own word, read straight from the process, on the port the supervisor already probes (its
    first heartbeat, readiness): no intermediary that may be down when a worker dies;
  - the heartbeats on NATS say the same, but reading them needs a NATS client in the supervisor, and NATS is one of
    the services it restarts: its view would have holes exactly when things die; Redis keeps no worker record;
  - a switch's answer goes to whoever asked (the gateway or the planner), not to the supervisor.
A dead worker answers nothing, so the supervisor reads every running worker's role every POLL_S and the stack keeps
the last one read (`Stack.role_of`): a switch is seen within POLL_S of completing. A worker that dies mid-switch still
shows its old role (the gauge flips only once the new role serves), which is right: that switch did not happen.
"""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

ROLE_GAUGE = "pdserve:worker_role"  # shared/telemetry/metrics.py WORKER_ROLE
POLL_S = 1.0  # how often the supervisor reads the roles of the running workers


def role_served(metrics_text: str) -> str | None:
    """The role whose `pdserve:worker_role` sample is 1 in a worker's /metrics text; None when none is (a worker
    that has not started serving, or a text that is not a worker's)."""
    # only the gauge's lines are parsed: a worker's whole text (expert loads, histograms) is read every POLL_S
    lines = "".join(line + "\n" for line in metrics_text.splitlines() if line.startswith(ROLE_GAUGE + "{"))
    serving = {
        sample.labels.get("role")
        for family in text_string_to_metric_families(lines)
        for sample in family.samples
        if sample.name == ROLE_GAUGE and sample.value == 1
    }
    return serving.pop() if len(serving) == 1 else None


def switched_message(name: str, before: str, role: str) -> str:
    """What `pdserve up` says when it reads that worker `name` switched role."""
    return f"{name} serves as {role} now (it was {before}): a restart starts it as {role}"
