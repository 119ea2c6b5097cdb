"""The supervisor of `pdserve up` and its rolling restart over stand-in processes: the real Stack, Supervisor and
RollingRestart, each service a small Python process that beats (a file the stand-in writes once it has "started",
which `beats` reads as a worker's first heartbeat), drains on SIGTERM, or exits at once with a chosen status. So
the process handling is real (signals, exits, restarts, timing) without models or servers, in seconds.

  - a service that exits 2 (it refused its configuration) is not restarted: the stack stops with status 2 and the
    end of its log; one that exits 1 (a crash) is restarted with backoff until it crash-loops;
  - a rolling restart replaces every worker one at a time and never leaves a role without a serving worker: the
    only worker of a role is replaced after its replacement beats; one of several drains first;
  - a replacement that fails stops the rolling restart, and the worker it would have replaced serves on;
  - SIGHUP to the supervisor runs it, and the restart counts stay 0 (a replacement is no crash);
  - a worker that switched role (a stand-in's role, as its /metrics would show it, changed by the test) comes back in
    that role — restarted after it died, or replaced in a rolling restart — with its worker id scheme and its launch
    role's flags; the rolling restart counts it in its new role.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

from services.local.restarts import RestartPolicy
from services.local.rolling import RollingRestart
from services.local.stack import Stack, StackSpec
from services.local.supervisor import Supervisor
from tests.e2e_support import scraped_total

# argv: <beat file> <exit status, or "" to run> <seconds before it beats> <seconds its drain takes>
STANDIN = """
import pathlib, signal, sys, time
beat, code, starts_s, drain_s = pathlib.Path(sys.argv[1]), sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
print("stand-in", sys.argv[1:], flush=True)
if code:
    print(f"pdserve: error: stand-in refuses (exit {code})", flush=True)
    sys.exit(int(code))
def drain(*_):
    beat.with_suffix(".term").touch()
    time.sleep(drain_s)
    sys.exit(0)
signal.signal(signal.SIGTERM, drain)
time.sleep(starts_s)
beat.touch()
while True:
    time.sleep(0.05)
"""


class StandInStack(Stack):
    """A Stack whose services are stand-ins: `behave[name]` is a list of (exit status or None, start seconds,
    drain seconds) for its successive processes (the last one repeats)."""

    def __init__(self, tmp: Path, prefill: int, decode: int, **spec_fields) -> None:
        spec = StackSpec(model="stand-in", prefill=prefill, decode=decode, nats_url="nats://unused:1",
                         redis_url="redis://unused:1", **spec_fields)  # fmt: skip
        super().__init__(spec, log_dir=str(tmp / "logs"), quiet=True)
        self.dir = tmp
        self.behave: dict[str, list[tuple[int | None, float, float]]] = {}
        self.started: dict[str, list[int]] = {}  # name → the ports (worker) or pids (gateway) of its processes
        self.args: dict[int, list[str]] = {}  # a /metrics port → the command line of the latest process on it
        self.commands: dict[str, list[list[str]]] = {}  # name → the command lines of its processes
        self.switched: dict[int, str] = {}  # a worker process's /metrics port → the role it switched to (the test's)

    def _start(self, name: str, args: list[str], env: dict[str, str] | None):
        import subprocess

        starts = self.started.setdefault(name, [])
        plan = self.behave.get(name, [(None, 0.2, 0.2)])
        code, starts_s, drain_s = plan[min(len(starts), len(plan) - 1)]
        port = int(args[args.index("--metrics-port") + 1]) if "--metrics-port" in args else 0
        starts.append(port)
        self.args[port] = args
        self.commands.setdefault(name, []).append(args)
        beat = self.dir / f"{name}-{len(starts)}-{port}.beat"
        path = self.log_path(name)
        assert path is not None  # quiet
        out = open(path, "ab")  # noqa: SIM115 (closed in stop(), as Stack's own)
        self._log_files.append(out)
        return subprocess.Popen([sys.executable, "-c", STANDIN, str(beat), "" if code is None else str(code),
                                 str(starts_s), str(drain_s)], stdout=out, stderr=subprocess.STDOUT)  # fmt: skip

    def beat_file(self, port: int) -> Path | None:
        return next(iter(self.dir.glob(f"*-{port}.beat")), None)

    def beats(self, name: str, metrics_port: int) -> bool:
        found = self.beat_file(metrics_port)
        return found is not None and found.exists()

    def role_at(self, port: int) -> str:
        """The role the worker process with /metrics `port` serves: its command's, or the one it switched to."""
        return self.switched.get(port, self.args[port][0])

    def read_role(self, name: str) -> str | None:  # what its /metrics would say once it beats
        port = self.metrics_ports[name]
        return self.role_at(port) if self.beats(name, port) else None

    def probe_ready(self) -> tuple[bool, str]:
        waiting = [n for n, port in self.metrics_ports.items() if not self.beats(n, port)]
        return (not waiting, f"waiting for {waiting}")


def serving(stack: StandInStack, role: str) -> int:
    """Processes of `role` that beat and have not been told to stop (in `procs` or in a hand-over)."""
    ports = [p for name, ports in stack.started.items() if name in stack.metrics_ports for p in ports]
    ports = [p for p in ports if stack.role_at(p) == role]
    count = 0
    for port in ports:
        beat = stack.beat_file(port)
        if beat is not None and beat.exists() and not beat.with_suffix(".term").exists():
            count += 1
    return count


def run_rolling(stack: StandInStack, said: list[str], timeout_s: float = 30.0, **kwargs) -> RollingRestart:
    """A RollingRestart driven as the supervisor drives it, checking after every tick that no role is empty."""
    options = {"stop_bound_s": 10.0, "start_timeout_s": 10.0} | kwargs
    rolling = RollingRestart(stack, time.monotonic(), swapped=lambda _: None, say=said.append, **options)
    deadline = time.monotonic() + timeout_s
    while not rolling.done:
        assert time.monotonic() < deadline, said
        rolling.tick(time.monotonic())
        for role in ("prefill", "decode"):
            assert serving(stack, role) >= 1, (role, said)
        time.sleep(0.05)
    return rolling


def started(stack: StandInStack, timeout_s: float = 20.0) -> StandInStack:
    stack.launch()
    deadline = time.monotonic() + timeout_s
    while not stack.probe_ready()[0]:
        assert time.monotonic() < deadline, stack.logs()
        time.sleep(0.05)
    return stack


@pytest.fixture
def stacks(tmp_path):
    made: list[StandInStack] = []

    def make(prefill: int = 1, decode: int = 1, **spec_fields) -> StandInStack:
        made.append(StandInStack(tmp_path, prefill, decode, **spec_fields))
        return made[-1]

    yield make
    for stack in made:
        stack.stop(timeout_s=5)


def test_a_refusing_service_stops_the_stack_without_a_restart(stacks, capfd):
    stack = stacks()
    stack.behave["decode-1"] = [(2, 0.0, 0.0)]
    began = time.monotonic()
    status = Supervisor(stack, drain_timeout_s=1.0, policy=RestartPolicy(first_delay_s=0.05)).run()
    err = capfd.readouterr().err
    assert status == 2, err
    assert time.monotonic() - began < 10
    assert len(stack.started["decode-1"]) == 1  # started once, never again
    assert "decode-1 refused its configuration (exit code 2), so it is not restarted" in err
    assert "stand-in refuses (exit 2)" in err  # the end of its log: the reason
    assert "restarting it" not in err


def test_a_crashing_service_is_restarted_until_it_crash_loops(stacks, capfd):
    stack = stacks()
    stack.behave["decode-1"] = [(1, 0.0, 0.0)]
    policy = RestartPolicy(first_delay_s=0.05, max_delay_s=1.0, max_exits=4, window_s=60.0)
    status = Supervisor(stack, drain_timeout_s=1.0, policy=policy).run()
    err = capfd.readouterr().err
    assert status == 1, err
    assert len(stack.started["decode-1"]) == 4
    assert [line.split("restarting it in ")[1].split(" s")[0] for line in err.splitlines()
            if "decode-1 exited (exit code 1)" in line and "restarting" in line] == ["0.05", "0.1", "0.2"]  # fmt: skip
    assert f"4 exits within 60 s. Its log: {stack.log_path('decode-1')}" in err


def test_rolling_restart_replaces_every_worker_and_never_empties_a_role(stacks):
    stack = started(stacks(prefill=1, decode=2))
    old = {name: proc for name, proc in stack.procs.items() if name != "gateway"}
    gateway = stack.procs["gateway"]
    said: list[str] = []
    rolling = run_rolling(stack, said)
    assert rolling.stopped is None and rolling.replaced == ["prefill-0", "decode-1", "decode-2"], said
    for name, proc in old.items():
        assert proc.poll() == 0, name  # drained (SIGTERM), not killed
        assert stack.procs[name] is not proc and stack.procs[name].poll() is None
        assert stack.beats(name, stack.metrics_ports[name])  # the stack knows the replacement's /metrics port
    assert stack.procs["gateway"] is gateway and gateway.poll() is None  # only workers roll
    assert stack.handover == []
    # the only prefill worker: its replacement first; each decode worker drained while the other served
    assert "prefill-0" in said[0] and "starts first" in said[0]
    assert any("decode-1" in line and "drains while the other decode workers serve" in line for line in said)
    # fresh worker ids and ports, the launch's flags otherwise
    args = stack._spawned["decode-1"][0]
    assert args[args.index("--worker-id") + 1] == f"decode-1-{os.getpid()}-1"


def test_a_failed_replacement_stops_the_rolling_restart_and_the_old_worker_serves_on(stacks):
    stack = started(stacks())
    old = stack.procs["prefill-0"]
    stack.behave["prefill-0"] = [(None, 0.2, 0.2), (1, 0.0, 0.0)]  # its replacement crashes at start
    said: list[str] = []
    rolling = run_rolling(stack, said)
    assert rolling.stopped is not None
    assert "prefill-0's replacement" in rolling.stopped and "exited (1)" in rolling.stopped
    assert rolling.replaced == []
    assert stack.procs["prefill-0"] is old and old.poll() is None  # untouched: never signalled
    assert serving(stack, "prefill") == 1
    assert stack.handover == []


def test_a_replacement_that_never_beats_is_given_up_after_the_start_timeout(stacks):
    stack = started(stacks())
    old = stack.procs["decode-1"]
    stack.behave["decode-1"] = [(None, 0.2, 0.2), (None, 60.0, 0.2)]  # its replacement never gets ready
    said: list[str] = []
    rolling = run_rolling(stack, said, start_timeout_s=1.0)
    assert rolling.stopped is not None and "sent no heartbeat within 1 s" in rolling.stopped
    assert rolling.replaced == ["prefill-0"]
    assert stack.procs["decode-1"] is old and old.poll() is None


def test_sighup_rolls_the_workers_of_a_supervised_stack(stacks, capfd):
    stack = stacks()
    supervisor = Supervisor(stack, drain_timeout_s=2.0)
    restarts: list[float] = []

    def operator() -> None:  # as a person would: wait for the ready stack, SIGHUP, wait for the end, SIGTERM
        deadline = time.monotonic() + 30
        while len(stack.procs) < 3 or not stack.probe_ready()[0]:
            if time.monotonic() > deadline:
                break
            time.sleep(0.1)
        time.sleep(0.5)  # the supervisor's loop saw it ready too
        os.kill(os.getpid(), signal.SIGHUP)
        while supervisor.rolled == 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        restarts.append(scraped_total(supervisor.metrics_url, "pdserve:supervisor_restarts_total"))
        os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=operator)
    thread.start()
    status = supervisor.run()  # the main thread: it installs the signal handlers
    thread.join()
    err = capfd.readouterr().err
    assert status == 0, err
    assert supervisor.rolled == 1, err
    assert "SIGHUP: rolling restart of 2 workers" in err and "rolling restart done: 2 workers replaced" in err
    assert len(stack.started["prefill-0"]) == len(stack.started["decode-1"]) == 2
    assert len(stack.started["gateway"]) == 1
    assert restarts == [0]  # a replacement is no restart


def operate(supervisor: Supervisor, stack: StandInStack, steps) -> threading.Thread:
    """`steps()` run as an operator would, once the supervised stack is ready; then SIGTERM to the supervisor."""

    def run() -> None:
        try:
            deadline = time.monotonic() + 30
            while len(stack.procs) < 3 or not stack.probe_ready()[0]:
                assert time.monotonic() < deadline, "the stand-in stack never got ready"
                time.sleep(0.1)
            time.sleep(0.5)  # the supervisor's loop saw it ready too
            steps()
        finally:
            os.kill(os.getpid(), signal.SIGTERM)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def wait_for(predicate, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "not within the time"
        time.sleep(0.05)


def test_a_switched_worker_that_dies_is_restarted_in_the_role_it_serves(stacks, capfd):
    stack = stacks(prefill=2, decode=1, role_args={"prefill": ("--kv-cache-bytes", "1000")})
    supervisor = Supervisor(stack, drain_timeout_s=1.0, policy=RestartPolicy(first_delay_s=0.05))

    def steps() -> None:
        first = stack.metrics_ports["prefill-0"]
        stack.switched[first] = "decode"  # the admin API or the planner switched it: its /metrics says so
        wait_for(lambda: stack.role_of("prefill-0") == "decode")  # the supervisor read it
        stack.procs["prefill-0"].kill()
        wait_for(lambda: (stack.dir / f"prefill-0-2-{first}.beat").exists())  # the restart beats

    thread = operate(supervisor, stack, steps)
    status = supervisor.run()
    thread.join()
    err = capfd.readouterr().err
    assert status == 0, err
    first, again = stack.commands["prefill-0"]
    assert first[0] == "prefill" and again[0] == "decode", err  # its role now, not its launch role
    assert again[1:] == first[1:]  # the same worker id and /metrics port, its launch role's flags
    assert again[again.index("--worker-id") + 1] == f"prefill-0-{os.getpid()}"
    assert again[again.index("--kv-cache-bytes") + 1] == "1000"
    assert "prefill-0 serves as decode now (it was prefill)" in err
    assert "prefill-0 exited (killed by SIGKILL)" in err and "restarting it in 0.05 s as decode" in err
    assert stack.role_of("prefill-1") == "prefill" and stack.role_of("decode-2") == "decode"


def test_a_rolling_restart_replaces_a_switched_worker_in_its_role_and_counts_roles_as_they_are(stacks):
    stack = started(stacks(prefill=2, decode=1))
    stack.switched[stack.metrics_ports["prefill-0"]] = "decode"  # now one prefill worker, two decode
    said: list[str] = []
    rolling = run_rolling(stack, said)  # checks after every tick that no role is left without a worker
    assert rolling.stopped is None and rolling.replaced == ["prefill-0", "prefill-1", "decode-2"], said
    assert said[0] == "prefill-0 serves as decode now (it was prefill): a restart starts it as decode"
    args = stack.args[stack.metrics_ports["prefill-0"]]
    assert args[0] == "decode" and args[args.index("--worker-id") + 1] == f"prefill-0-{os.getpid()}-1"
    # prefill-0 is one of two decode workers now: it drains first; prefill-1 is the only prefill worker: surge
    assert any("prefill-0" in line and "drains while the other decode workers serve" in line for line in said), said
    assert any(line.startswith("prefill-1 (pid") and "prefill): its replacement" in line for line in said), said
    assert {name: stack.role_at(stack.metrics_ports[name]) for name in ("prefill-0", "prefill-1", "decode-2")} == {
        "prefill-0": "decode", "prefill-1": "prefill", "decode-2": "decode"}  # fmt: skip


def test_a_worker_switched_while_its_replacement_starts_is_replaced_again_in_its_new_role(stacks):
    stack = started(stacks(prefill=1, decode=2))
    old = stack.procs["prefill-0"]
    stack.behave["prefill-0"] = [(None, 0.2, 0.2), (None, 1.0, 0.2)]  # replacements beat after 1 s
    said: list[str] = []
    rolling = RollingRestart(stack, time.monotonic(), 10.0, 10.0, swapped=lambda _: None, say=said.append)
    rolling.tick(time.monotonic())  # prefill-0, the only prefill worker: its replacement starts first
    assert rolling.current is not None and rolling.current.surge and len(stack.started["prefill-0"]) == 2
    stale = stack.started["prefill-0"][1]
    stack.switched[stack.metrics_ports["prefill-0"]] = "decode"  # meanwhile the old one switched (a mixed-up race)
    deadline = time.monotonic() + 30
    while not rolling.done:
        assert time.monotonic() < deadline, said
        rolling.tick(time.monotonic())
        time.sleep(0.05)
    assert rolling.stopped is None, said
    assert any("prefill-0 switched to decode while its prefill replacement" in line for line in said), said
    beat = stack.beat_file(stale)
    assert stack.args[stale][0] == "prefill" and beat is not None and beat.with_suffix(".term").exists()  # drained
    ports = stack.started["prefill-0"]
    assert len(ports) == 3 and stack.metrics_ports["prefill-0"] == ports[2]
    assert [args[0] for args in stack.commands["prefill-0"]] == ["prefill", "prefill", "decode"]
    assert old.poll() == 0 and stack.procs["prefill-0"].poll() is None
    assert rolling.replaced[0] == "prefill-0" and stack.handover == []
