"""`pdserve up` as users run it: the real command in the background of a shell script (so SIGINT arrives
ignored, as it does from any script's `... &`), signalled and killed for real, its children counted from /proc.

  - SIGTERM / SIGINT to it: every process it started is gone within the drain time, the port is free, the
    services drained (they logged it) and it exits 0;
  - SIGKILL to it: its children notice (parent-death signal) and exit within seconds;
  - SIGKILL to its only decode worker mid-stream: a replacement serves, the stream completes token for token
    as the single-process engine writes it, the restart is counted; redis-server killed: restarted too;
  - a configuration it would refuse (a missing checkpoint, a port in use, a bad flag): said at once, exit 2,
    nothing started; a service that refuses its configuration later (exit 2) is not restarted: the stack stops
    with its reason (a service that crashes is restarted until it crash-loops:
    tests/integration/test_supervisor_standins.py).
"""

from __future__ import annotations

import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from services.local.children import descendants, running
from services.local.infra import free_port
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.tokenizer import Tokenizer
from tests.chaos import Outcome, Progress, SteadyLoad, stream_completion
from tests.e2e_support import scraped_total

DRAIN_S = 3.0
STOP_BOUND_S = DRAIN_S + 5.0 + 4.0  # the supervisor's drain + grace, and some slack for a loaded machine
FAST = {  # a dead worker is noticed in seconds (as in test_faults)
    "PDSERVE_WORKER_TTL_S": "2",
    "PDSERVE_STALL_TIMEOUT_S": "10",
    "PDSERVE_KV_LEASE_S": "4",
    "PDSERVE_KV_TRANSFER_TIMEOUT_S": "5",
    "PDSERVE_JOB_ACK_WAIT_S": "6",
}
PROMPT = "Tell me a story about disaggregation"
MAX_TOKENS = 160


def port_free(port: int) -> bool:
    """Nothing listens on it: a server could bind it now (SO_REUSEADDR, as servers do: connections of the
    stopped one may linger in TIME_WAIT)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def wait_until(predicate, timeout_s: float, what: str) -> float:
    """Seconds it took `predicate` to hold; fails the test after `timeout_s`."""
    start = time.monotonic()
    while not predicate():
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.1)
    return time.monotonic() - start


class Up:
    """`pdserve up` started in the background of `bash -c` (SIGINT ignored, as from a script); bash stays to
    reap it and report its exit status. Output in tmp/up.txt, each service's log in tmp/logs/."""

    def __init__(self, tmp: Path, model_dir: Path, *flags: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.out = tmp / "up.txt"
        self.log_dir = tmp / "logs"
        cmd = [sys.executable, "-m", "services.cli", "up", "--model", str(model_dir), "--port", str(self.port),
               "--threads-per-worker", "1", "--drain-timeout-s", str(DRAIN_S), "--log-dir", str(self.log_dir),
               *flags]  # fmt: skip
        script = f'{shlex.join(cmd)} > {shlex.quote(str(self.out))} 2>&1 & echo $!; wait $!; echo "rc=$?"'
        self.shell = subprocess.Popen(["bash", "-c", script], stdout=subprocess.PIPE, text=True,
                                      env=os.environ | FAST | (env or {}), start_new_session=True)  # fmt: skip
        self.pid = int(self.shell.stdout.readline())
        self.seen: set[int] = set()  # every process seen below pdserve up

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def children(self) -> list[int]:
        kids = descendants(self.pid)
        self.seen |= set(kids)
        return kids

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while "pdserve is ready" not in self.output():
            if self.shell.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"pdserve up did not get ready:\n{self.output()[-4000:]}")
            time.sleep(0.3)
        self.children()

    def pid_of(self, what: str) -> int | None:
        """The pid of its child `pdserve <what>` (a role) or `<what>` (a binary: redis-server); None if none."""
        for pid in self.children():
            try:
                command = Path(f"/proc/{pid}/comm").read_text().strip()  # redis-server rewrites its argv
                args = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if command == what or args[2:4] == [b"services.cli", what.encode()]:
                return pid
        return None

    def supervisor_metrics(self) -> str:
        return re.search(r"supervisor: (\S+/metrics)", self.output()).group(1)

    def exit_status(self, timeout_s: float) -> int:
        """pdserve up's exit status as bash reports it."""
        try:
            out, _ = self.shell.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"pdserve up still running after {timeout_s:g} s:\n{self.output()[-3000:]}")
        return int(re.search(r"rc=(\d+)", out).group(1))

    def kill_all(self) -> None:
        """Test cleanup: whatever is left, killed."""
        for pid in [self.pid, *self.seen, *descendants(self.pid)]:
            if running(pid):
                os.kill(pid, signal.SIGKILL)
        self.shell.wait(30)


@pytest.fixture
def launch(tmp_path, model_dir):
    started: list[Up] = []

    def start(*flags: str, env: dict[str, str] | None = None) -> Up:
        started.append(Up(tmp_path, model_dir, *flags, env=env))
        return started[-1]

    yield start
    for up in started:
        up.kill_all()


def described(pids: list[int]) -> str:
    """`pid command line` of each, for a failure message that says which process lingered."""
    lines = []
    for pid in pids:
        try:
            args = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            args = "(gone)"
        lines.append(f"{pid} {args[:200]}")
    return "\n".join(lines)


def assert_all_gone(up: Up, timeout_s: float) -> None:
    start = time.monotonic()
    while left := [pid for pid in up.seen | {up.pid} if running(pid)]:
        if time.monotonic() - start > timeout_s:
            pytest.fail(f"still running {timeout_s:g} s on:\n{described(left)}\n{up.output()[-2000:]}")
        time.sleep(0.1)
    assert port_free(up.port)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint-from-a-script"])
def test_a_signal_stops_everything_it_started(launch, sig):
    up = launch("--mixed", "1")
    up.wait_ready()
    assert len(up.seen) >= 4, up.seen  # nats-server, redis-server, the worker, the gateway
    os.kill(up.pid, sig)
    assert up.exit_status(STOP_BOUND_S) == 0, up.output()
    assert_all_gone(up, 2.0)
    # drained, not killed: each service logged its drain and none needed SIGKILL
    assert "drained: nothing in flight" in (up.log_dir / "gateway.log").read_text()
    assert "draining: taking no new jobs" in (up.log_dir / "mixed-0.log").read_text()
    assert "killing it" not in up.output()


def test_its_children_exit_when_it_is_killed(launch):
    up = launch("--mixed", "1")
    up.wait_ready()
    assert len(up.seen) >= 4, up.seen
    os.kill(up.pid, signal.SIGKILL)
    assert up.exit_status(10) == 128 + signal.SIGKILL
    # the services end themselves by DRAIN_S + 5 s (lifecycle.exit_by) whatever holds them; the slack is for
    # a loaded CI host, where the interpreter's own start of the exit and the /proc reads lag
    assert_all_gone(up, STOP_BOUND_S + 4.0)


@pytest.fixture(scope="module")
def reference(model_dir) -> str:
    tok = Tokenizer(model_dir)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    [out] = Engine.from_dir(model_dir, max_model_len=2048).generate([tok.encode(PROMPT)], params)
    return tok.decode(out)


@pytest.mark.slow  # a whole stack or spawned ranks, > ~30 s on 2 cores: the slow tier (CI runs it)
def test_a_dead_worker_is_replaced_while_the_rest_serves(launch, reference):
    up = launch("--prefill", "1", "--decode", "1")
    up.wait_ready()
    metrics = up.supervisor_metrics()
    victim = up.pid_of("decode")
    progress = Progress(1)
    result: list[Outcome] = []
    streamer = threading.Thread(target=lambda: result.append(stream_completion(up.url, PROMPT, MAX_TOKENS,
                                                                               progress)))  # fmt: skip
    streamer.start()
    progress.wait(lambda p: p.counts[0] >= 8)
    assert not progress.ended[0]  # mid-stream at the kill
    os.kill(victim, signal.SIGKILL)
    took = wait_until(lambda: up.pid_of("decode") not in (None, victim), 10, "a new decode worker")
    streamer.join(150)
    [outcome] = result
    assert outcome.verdict == "completed", outcome
    assert outcome.text == reference  # no token repeated or missing across the replacement
    assert took < 5
    assert scraped_total(metrics, "pdserve:supervisor_restarts_total", service="decode-1") == 1
    assert scraped_total(metrics, "pdserve:supervisor_restarts_total") == 1  # nothing else restarted
    assert "decode-1 exited (killed by SIGKILL)" in up.output()

    # redis-server dies: restarted on its port, and the stack serves again
    os.kill(up.pid_of("redis-server"), signal.SIGKILL)
    wait_until(lambda: scraped_total(metrics, "pdserve:supervisor_restarts_total", service="redis") == 1, 20,
               "redis restarted")  # fmt: skip
    again = stream_completion(up.url, PROMPT, MAX_TOKENS)
    assert again.verdict == "completed" and again.text == reference, again
    os.kill(up.pid, signal.SIGTERM)
    assert up.exit_status(STOP_BOUND_S) == 0
    assert_all_gone(up, 2.0)


REFUSED_WITHIN_S = 10.0  # the bound for a configuration refused before anything starts


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("missing checkpoint", "/nonexistent: no config.json"),
        ("port in use", "is in use (another pdserve up, or another server?): choose another with --port"),
        ("bad flag", "the decode workers' settings: unrecognized arguments: --bogus 3"),
    ],
)
def test_a_refused_configuration_starts_nothing_and_exits_at_once(launch, taken_port, case, message):
    """The preflight (services/local/preflight.py): the one message, exit status 2 within seconds, no process
    started — not services restarted until the supervisor gives up."""
    flags = {"missing checkpoint": ["--model", "/nonexistent"], "port in use": ["--port", str(taken_port)],
             "bad flag": ["--decode-args=--bogus 3"]}[case]  # fmt: skip
    began = time.monotonic()
    up = launch(*flags)  # later flags win over the launcher's own --model and --port
    started: set[str] = set()  # the command of every process it starts (none but helpers, if it works)
    while up.shell.poll() is None and time.monotonic() - began < REFUSED_WITHIN_S + 20:
        started |= {described([pid]) for pid in up.children()}
        time.sleep(0.05)
    assert up.exit_status(5) == 2
    took = time.monotonic() - began
    out = up.output()
    assert out.startswith("pdserve: error: ") and message in out and out.count("error") == 1, out
    assert took < REFUSED_WITHIN_S, f"{took:.1f} s: {out}"
    # nothing started: no server, no service (ctypes' library lookup may run ldconfig, a helper; caught between its
    # fork and its exec, that helper still shows pdserve up's own command line, which no service has)
    services = [c for c in started if "services.cli up " not in c]
    assert not [c for c in services if any(n in c for n in ("services.cli", "nats-server", "redis-server"))], started
    assert "restarting" not in out


def test_a_service_that_refuses_its_configuration_is_not_restarted(launch):
    """What the preflight cannot see (the engine refuses a KV budget smaller than one request, at its build):
    the worker exits 2, and the stack stops with its reason at once instead of restarting it."""
    up = launch("--mixed", "1", "--mixed-args=--kv-cache-bytes 1")
    deadline = time.monotonic() + 120
    while up.shell.poll() is None and time.monotonic() < deadline:
        up.children()  # every process it starts, for the check that none is left
        time.sleep(0.2)
    assert up.exit_status(5) == 2
    out = up.output()
    log = up.log_dir / "mixed-0.log"
    assert f"mixed-0 refused its configuration (exit code 2), so it is not restarted. The end of its log ({log})" in out
    assert "raise kv_cache_bytes" in out  # its reason, quoted from its log
    assert "restarting" not in out and "stopping the stack" in out
    assert_all_gone(up, 2.0)


# A rolling restart (SIGHUP) and a prefill drain that must wait for its held KV, on one `pdserve up`: a drain long
# enough for both, KV leases that do not run out meanwhile, every prompt computed by the prefill worker (remote),
# and a stall bound past the seconds the decode worker is stopped for.
ROLLING_ENV = {"PDSERVE_KV_LEASE_S": "60", "PDSERVE_STALL_TIMEOUT_S": "60", "PDSERVE_PREFILL_PATH": "remote"}
ROLLING_DRAIN_S = "30"
ROLL_PROMPTS = ["The quick brown fox", "héllo wörld, 世界", "Tell me a story about disaggregation"]
ROLL_TOKENS = 48


@pytest.fixture(scope="module")
def rolling_up(tmp_path_factory, model_dir):
    up = Up(tmp_path_factory.mktemp("rolling"), model_dir, "--prefill", "1", "--decode", "1",
            "--drain-timeout-s", ROLLING_DRAIN_S, env=ROLLING_ENV)  # fmt: skip
    try:
        up.wait_ready()
        yield up
    finally:
        up.kill_all()


@pytest.fixture(scope="module")
def roll_references(model_dir) -> dict[str, str]:
    tok = Tokenizer(model_dir)
    params = SamplingParams(max_tokens=ROLL_TOKENS, temperature=0.0, ignore_eos=True)
    outs = Engine.from_dir(model_dir, max_model_len=2048).generate([tok.encode(p) for p in ROLL_PROMPTS], params)
    return {p: tok.decode(out) for p, out in zip(ROLL_PROMPTS, outs, strict=True)}


def worker_metrics(up: Up) -> list[str]:
    """The workers' /metrics URLs, as the ready message lists them (prefill-0, decode-1)."""
    found = re.search(r"metrics: \S+ \(gateway\), (.*)", up.output())
    assert found is not None, up.output()
    return [url.strip() for url in found.group(1).split(",")]


@pytest.mark.slow  # a whole stack or spawned ranks, > ~30 s on 2 cores: the slow tier (CI runs it)
def test_a_draining_prefill_worker_exits_only_once_its_held_kv_is_pulled(rolling_up, reference):
    """The decode worker is stopped (SIGSTOP) while the prefill worker computes a prompt, so the KV it holds is not
    pulled; the prefill worker gets SIGTERM and drains: it keeps running, holding the KV, until the decode worker
    resumes and pulls it, then exits 0. The stream is whole and token-exact, and its KV was pulled, not
    recomputed."""
    up = rolling_up
    decode_metrics = worker_metrics(up)[1]
    pulls = scraped_total(decode_metrics, "pdserve:kv_transfer_seconds_count", role="decode")
    prefill, decode = up.pid_of("prefill"), up.pid_of("decode")
    os.kill(decode, signal.SIGSTOP)
    try:
        progress = Progress(1)
        result: list[Outcome] = []
        streamer = threading.Thread(target=lambda: result.append(stream_completion(up.url, PROMPT, MAX_TOKENS,
                                                                                   progress)))  # fmt: skip
        streamer.start()
        progress.wait(lambda p: p.counts[0] >= 1)  # the prefill worker's first token: its KV held for decode
        os.kill(prefill, signal.SIGTERM)
        time.sleep(4.0)
        assert running(prefill), "the prefill worker exited with KV held that nobody pulled"
        assert progress.counts[0] == 1  # nothing decoded yet
    finally:
        os.kill(decode, signal.SIGCONT)
    wait_until(lambda: not running(prefill), 30, "the prefill worker exits once its KV is pulled")
    streamer.join(120)
    [outcome] = result
    assert outcome.verdict == "completed" and outcome.text == reference, outcome
    assert scraped_total(decode_metrics, "pdserve:kv_transfer_seconds_count", role="decode") == pulls + 1
    assert scraped_total(decode_metrics, "pdserve:kv_transfer_failures_total") == 0
    wait_until(lambda: "prefill-0 exited (exit code 0)" in up.output(), 10, "the supervisor saw a clean exit")
    assert "drained in" in (up.log_dir / "prefill-0.log").read_text()
    wait_until(lambda: up.pid_of("prefill") not in (None, prefill), 10, "the supervisor restarts it")
    wait_until(lambda: _ready(up.url), 120, "the stack serves again")


def _ready(url: str) -> bool:
    try:
        return httpx.get(f"{url}/ready", timeout=5).status_code == 200
    except httpx.TransportError:
        return False


@pytest.mark.slow  # a whole stack or spawned ranks, > ~30 s on 2 cores: the slow tier (CI runs it)
def test_a_rolling_restart_under_streaming_load_fails_no_request(rolling_up, roll_references):
    """SIGHUP to `pdserve up` under a steady streaming load: every worker is replaced (a new process each), one at
    a time, and every request — those in flight as workers drained included — completes token for token."""
    up = rolling_up
    wait_until(lambda: _ready(up.url), 120, "the stack serves")
    before = {role: up.pid_of(role) for role in ("prefill", "decode")}
    metrics = up.supervisor_metrics()
    restarts = scraped_total(metrics, "pdserve:supervisor_restarts_total")
    load = SteadyLoad(up.url, ROLL_PROMPTS, ROLL_TOKENS, clients=3)
    try:
        wait_until(lambda: load.completed_by(time.monotonic()) >= 3, 120, "the load runs")
        hup = time.monotonic()
        os.kill(up.pid, signal.SIGHUP)
        wait_until(lambda: "rolling restart done" in up.output() or "rolling restart stopped" in up.output(), 300,
                   "the rolling restart ends")  # fmt: skip
        done = time.monotonic()
        time.sleep(2.0)  # the replacements serve requests too
    finally:
        outcomes = load.stop()
    out = up.output()
    assert "rolling restart done: 2 workers replaced" in out, out[-3000:]
    failed = [o for _, _, o in outcomes if o.verdict != "completed" or o.text != roll_references[o.prompt]]
    assert not failed, failed[:3]
    during = [o for began, end, o in outcomes if began < done and end > hup]
    assert len(during) >= 3, "no request was in flight during the rolling restart"
    after = {role: up.pid_of(role) for role in ("prefill", "decode")}
    assert all(after[role] not in (None, before[role]) for role in after), (before, after)
    assert scraped_total(metrics, "pdserve:supervisor_restarts_total") == restarts  # nothing crashed
    os.kill(up.pid, signal.SIGTERM)
    assert up.exit_status(float(ROLLING_DRAIN_S) + 15) == 0
    assert_all_gone(up, 2.0)
