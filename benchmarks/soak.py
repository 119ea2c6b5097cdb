"""A bounded soak: a whole stack under mixed load for a while, then an account of every request and of every
process's memory.

    .venv/bin/python benchmarks/soak.py [--duration 300] [--clients 12] [--max-pending-requests 4] [--out FILE]

It starts a stack (`pdserve up`'s launcher: nats-server, redis-server, gateway, 1 prefill + 1 decode worker) and
runs `--clients` client loops for `--duration` seconds, each sending one request after another, drawn from a mix:
short and long prompts, streaming and not, clients that disconnect mid-stream, and requests cut short by a stop
string (the stop is a piece of that prompt's greedy answer, learnt at warm-up, so it does match and the gateway
cancels the rest upstream). A small `--max-pending-requests` makes the gateway refuse some requests with 429;
clients then wait as `Retry-After` says (at most --max-backoff-s). Every `--sample-s` seconds it reads the RSS
(VmRSS in /proc/<pid>/status) of each process: gateway, workers, nats, redis.

Each request ends as exactly one of:
    completed        200 and a whole answer: a finish_reason, as many tokens as max_tokens when it is "length",
                     streams with one chunk per token and [DONE] last (a stop-string request: finish "stop")
    failed_cleanly   an HTTP error with an OpenAI error body (429 included, also counted apart), or a stream that
                     ends with an error event and [DONE]
    disconnected     the client went away on purpose
    stop_mismatch    whole, but a stop-string request did not end where its greedy reference does (wrong)
    lost             anything else: no answer, a truncated stream, a malformed body. Must be 0.

After the load it waits (at most --settle-s) until no `pd:*` Redis key is left and every worker's KV is free,
then reads one heartbeat per worker (block accounting: integrity_error must be None).

Printed and written to --out (JSON): the request counts (by kind too), RSS per process at the start (after the
warm-up) and the end of the load, its maximum, and the slope (MiB/min) of a least-squares line over the second
half of the load; leftover keys; the workers' heartbeats; the verdict. Exit status 1 when a request was lost, a
key or a KV block was left behind, a worker's block accounting is broken, or memory grew: a process's RSS rose by
more than --max-growth-mib from start to end, or (when the fit spans at least --min-fit-s) its slope exceeds
--max-slope-mib-per-min.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from services.demo_model import ensure_demo_checkpoint  # noqa: E402
from services.local.cluster_state import wait_settled  # noqa: E402
from services.local.infra import free_port  # noqa: E402
from services.local.stack import Stack, StackSpec  # noqa: E402
from shared.messages import Heartbeat  # noqa: E402

WORDS = ("prefill decode expert router token cache block stream worker gateway batch queue latency "
         "mixture sparse dense layer head value key query memory transfer lease ticket").split()  # fmt: skip
# kind → (weight, stream, prompt words (min, max), max_tokens (min, max))
KINDS = {
    "short": (25, False, (3, 30), (4, 48)),
    "short_stream": (25, True, (3, 30), (4, 48)),
    "long": (10, False, (80, 160), (32, 160)),
    "long_stream": (15, True, (80, 160), (32, 160)),
    "disconnect": (12, True, (10, 120), (96, 200)),  # reads 1-8 chunks, then hangs up
    "stop": (13, None, (0, 0), (0, 0)),  # a warm-up prompt whose answer holds the stop string
}
STOP_PROMPTS = 6
STOP_MAX_TOKENS = 48


def log(message: str) -> None:
    print(f"[soak {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ---- one request --------------------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    outcomes: Counter = field(default_factory=Counter)  # outcome → count
    by_kind: dict[str, Counter] = field(default_factory=dict)
    statuses: Counter = field(default_factory=Counter)  # HTTP status of clean failures
    rejected_429: int = 0
    examples: list[str] = field(default_factory=list)  # why requests were lost or wrong (the first 20)

    def add(self, kind: str, outcome: str, status: int | None = None, why: str = "") -> None:
        self.outcomes[outcome] += 1
        self.by_kind.setdefault(kind, Counter())[outcome] += 1
        if outcome == "failed_cleanly" and status is not None:
            self.statuses[str(status)] += 1
            self.rejected_429 += status == 429
        if outcome in ("lost", "stop_mismatch") and len(self.examples) < 20:
            self.examples.append(f"{outcome} {kind}: {why}")


@dataclass(frozen=True)
class Plan:
    kind: str
    body: dict
    stream: bool
    disconnect_after: int = 0  # chunks to read before hanging up (disconnect)
    expect_text: str | None = None  # stop: the greedy answer up to the stop string


def is_error_body(raw: bytes) -> bool:
    try:
        error = json.loads(raw)["error"]
        return isinstance(error["message"], str) and isinstance(error["code"], int)
    except (ValueError, KeyError, TypeError):
        return False


def judge_whole(plan: Plan, answer: dict) -> tuple[str, str]:
    """A 200 JSON answer: (outcome, why not completed)."""
    try:
        choice, tokens = answer["choices"][0], answer["usage"]["completion_tokens"]
        text, finish = choice["text"], choice["finish_reason"]
    except (KeyError, IndexError, TypeError):
        return "lost", f"malformed body {str(answer)[:200]}"
    return judge_end(plan, text, finish, tokens)


def judge_end(plan: Plan, text: str, finish: str | None, tokens: int) -> tuple[str, str]:
    """A whole answer's end: completed, lost (it is not whole), or stop_mismatch (whole, but a stop-string
    request did not end where the same greedy request ended at warm-up: a wrong answer, not a lost one)."""
    if finish not in ("stop", "length"):
        return "lost", f"finish_reason {finish!r}"
    if finish == "length" and tokens != plan.body["max_tokens"]:
        return "lost", f"finish length after {tokens} of {plan.body['max_tokens']} tokens"
    if plan.expect_text is not None and (finish != "stop" or text != plan.expect_text):
        return "stop_mismatch", f"finish {finish}, {text[:40]!r} vs {plan.expect_text[:40]!r}"
    return "completed", ""


async def run_one(client: httpx.AsyncClient, url: str, plan: Plan, tally: Tally) -> float:
    """Send one request and tally its outcome; returns seconds to back off (429: Retry-After)."""
    tally.sent += 1
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=plan.body) as resp:
            if resp.status_code != 200:
                raw = await resp.aread()
                if not is_error_body(raw):
                    tally.add(plan.kind, "lost", why=f"HTTP {resp.status_code} without an error body: {raw[:200]!r}")
                    return 0.0
                tally.add(plan.kind, "failed_cleanly", resp.status_code)
                return float(resp.headers.get("retry-after", 0)) if resp.status_code == 429 else 0.0
            if not plan.stream:
                outcome, why = judge_whole(plan, json.loads(await resp.aread()))
                tally.add(plan.kind, outcome, why=why)
                return 0.0
            await read_stream(resp, plan, tally)
    except (httpx.HTTPError, ValueError) as exc:  # no answer, a cut connection, bad JSON
        tally.add(plan.kind, "lost", why=f"{type(exc).__name__}: {exc}")
    return 0.0


async def read_stream(resp: httpx.Response, plan: Plan, tally: Tally) -> None:
    text, finish, chunks, error, done = "", None, 0, False, False
    async for line in resp.aiter_lines():
        if not line:
            continue
        if not line.startswith("data: ") or done:
            tally.add(plan.kind, "lost", why=f"bad SSE line {line[:120]!r}")
            return
        payload = line[len("data: ") :]
        if payload == "[DONE]":
            done = True
            continue
        event = json.loads(payload)
        if "error" in event:
            error = True
            continue
        chunks += 1
        text += event["choices"][0]["text"]
        finish = event["choices"][0]["finish_reason"] or finish
        if plan.disconnect_after and chunks >= plan.disconnect_after and finish is None:
            tally.add(plan.kind, "disconnected")
            return  # leaving the block closes the connection mid-stream
    if not done:
        tally.add(plan.kind, "lost", why=f"stream ended without [DONE] after {chunks} chunks")
    elif error:
        tally.add(plan.kind, "failed_cleanly", 200)
    else:
        outcome, why = judge_end(plan, text, finish, chunks)
        tally.add(plan.kind, outcome, why=why)


# ---- the load -----------------------------------------------------------------------------------------


def words(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def draw(rng: random.Random, stops: list[tuple[dict, str, str]]) -> Plan:
    kinds = list(KINDS)
    kind = rng.choices(kinds, weights=[KINDS[k][0] for k in kinds])[0]
    if kind == "stop" and stops:
        body, stop, before_stop = rng.choice(stops)
        stream = rng.random() < 0.5
        return Plan(kind, body | {"stop": [stop], "stream": stream}, stream, expect_text=before_stop)
    if kind == "stop":
        kind = "short"
    _, stream, (wlo, whi), (tlo, thi) = KINDS[kind]
    body = {
        "prompt": words(rng, wlo, whi),
        "max_tokens": rng.randint(tlo, thi),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "ignore_eos": rng.random() < 0.8,
        "stream": bool(stream),
    }
    return Plan(kind, body, bool(stream), rng.randint(1, 8) if kind == "disconnect" else 0)


async def learn_stops(client: httpx.AsyncClient, url: str, rng: random.Random) -> list[tuple[dict, str, str]]:
    """Greedy answers of a few prompts, and a stop string from the middle of each (where it first occurs)."""
    stops = []
    for i in range(STOP_PROMPTS):
        body = {"prompt": f"{i} " + words(rng, 5, 40), "max_tokens": STOP_MAX_TOKENS, "temperature": 0.0,
                "ignore_eos": True}  # fmt: skip
        resp = await client.post(f"{url}/v1/completions", json=body)
        resp.raise_for_status()
        answer = resp.json()["choices"][0]["text"]
        # a stop string from the middle on: 3 printable characters (random weights write odd bytes)
        for at in range(len(answer) // 3, len(answer) - 3):
            stop = answer[at : at + 3]
            if stop.isprintable() and stop.strip() and "\ufffd" not in stop:
                stops.append((body, stop, answer[: answer.find(stop)]))
                break
    return stops


async def client_loop(i: int, url: str, client: httpx.AsyncClient, stops, until: float, tally: Tally, args) -> None:
    rng = random.Random(args.seed * 1000 + i)
    while time.monotonic() < until:
        plan = draw(rng, stops)
        backoff = await run_one(client, url, plan, tally)
        if backoff:
            await asyncio.sleep(min(backoff, args.max_backoff_s) * rng.uniform(0.5, 1.0))


async def drive(url: str, args, sampler: RssSampler) -> tuple[Tally, dict]:
    tally = Tally()
    timeout = httpx.Timeout(args.request_timeout_s, connect=10.0)
    limits = httpx.Limits(max_connections=args.clients + 4, max_keepalive_connections=args.clients + 4)
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
        stops = await learn_stops(client, url, random.Random(args.seed))
        start = time.monotonic()
        warmup_s = args.warmup_s if args.warmup_s is not None else min(45.0, max(3.0, args.duration * 0.15))
        until = start + args.duration
        loops = [
            asyncio.create_task(client_loop(i, url, client, stops, until, tally, args)) for i in range(args.clients)
        ]
        await asyncio.sleep(warmup_s)
        phases = {"load_start": time.monotonic()}
        sampler.mark("load_start")
        log(f"warm-up done ({warmup_s:.0f} s, {tally.sent} requests); load until {args.duration:.0f} s")
        while (now := time.monotonic()) < until:
            await asyncio.sleep(min(30.0, until - now))
            log(f"{tally.sent} sent: " + ", ".join(f"{k} {v}" for k, v in sorted(tally.outcomes.items())))
        phases["load_end"] = time.monotonic()
        sampler.mark("load_end")
        # the loops send nothing new now; what is in flight gets its own timeout to finish
        done, pending = await asyncio.wait(loops, timeout=args.request_timeout_s + 10)
        for task in pending:
            task.cancel()
        for _ in range(tally.sent - sum(tally.outcomes.values())):  # cut off above: no answer in time
            tally.add("unfinished", "lost", why=f"no answer within {args.request_timeout_s + 10:g} s of the end")
        for task in done:
            if task.exception() is not None:
                raise task.exception()
        phases["stop_prompts"] = len(stops)
    return tally, phases


# ---- memory -------------------------------------------------------------------------------------------


def rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class RssSampler:
    """A thread sampling each named process's RSS every `interval_s`."""

    def __init__(self, pids: dict[str, int], interval_s: float) -> None:
        self.pids = pids
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.marks: dict[str, int] = {}  # name → index of the first sample taken at or after the mark
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _sample(self) -> None:
        values = {name: rss_mib(pid) for name, pid in self.pids.items()}
        self.samples.append((time.monotonic(), {k: v for k, v in values.items() if v is not None}))

    def _run(self) -> None:
        while not self._stop.is_set():
            self._sample()
            self._stop.wait(self.interval_s)

    def mark(self, name: str) -> None:
        self._sample()  # a sample exactly at the mark
        self.marks[name] = len(self.samples) - 1

    def offset(self, mark: str) -> float:
        return round(self.samples[self.marks[mark]][0] - self.samples[0][0], 1)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def series(self) -> dict[str, list]:
        """Every sample: seconds since the first, and each process's MiB (None when it could not be read)."""
        t0 = self.samples[0][0]
        out: dict[str, list] = {"t_s": [round(t - t0, 1) for t, _ in self.samples]}
        for name in self.pids:
            out[name] = [None if name not in v else round(v[name], 1) for _, v in self.samples]
        return out

    def report(self) -> dict[str, dict]:
        first, last = self.marks["load_start"], self.marks["load_end"]
        window = self.samples[first : last + 1]
        t0, t1 = window[0][0], window[-1][0]
        half = [(t, v) for t, v in window if t >= (t0 + t1) / 2]
        out = {}
        for name in self.pids:
            series = [(t, v[name]) for t, v in window if name in v]
            fit = [(t, v[name]) for t, v in half if name in v]
            if not series:
                continue
            out[name] = {
                "start_mib": round(series[0][1], 1),
                "end_mib": round(series[-1][1], 1),
                "max_mib": round(max(v for _, v in series), 1),
                "growth_mib": round(series[-1][1] - series[0][1], 1),
                "slope_mib_per_min": round(slope_per_min(fit), 2) if len(fit) >= 2 else None,
                "fit_s": round(fit[-1][0] - fit[0][0], 1) if len(fit) >= 2 else 0.0,
                "samples": len(series),
            }
        return out


def slope_per_min(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MiB), in MiB per minute."""
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    return 0.0 if var == 0 else 60.0 * sum((t - mt) * (v - mv) for t, v in points) / var


# ---- after the load -------------------------------------------------------------------------------------


# ---- main -----------------------------------------------------------------------------------------------


def verdict(tally: Tally, rss: dict, beats: dict[str, Heartbeat], leftover: list[str], args) -> list[str]:
    """What went wrong; `leftover`: what the run left behind (shared/cluster_state.leftovers)."""
    problems = []
    if tally.outcomes["lost"]:
        problems.append(f"{tally.outcomes['lost']} request(s) lost")
    if tally.outcomes["stop_mismatch"]:
        problems.append(f"{tally.outcomes['stop_mismatch']} stop-string answer(s) differ from the greedy reference")
    for name, r in rss.items():
        if r["growth_mib"] > args.max_growth_mib:
            problems.append(f"{name}: RSS grew {r['growth_mib']} MiB (limit {args.max_growth_mib})")
        if r["fit_s"] >= args.min_fit_s and r["slope_mib_per_min"] > args.max_slope_mib_per_min:
            problems.append(f"{name}: RSS slope {r['slope_mib_per_min']} MiB/min (limit {args.max_slope_mib_per_min})")
    if len(beats) != args.prefill + args.decode:
        problems.append(f"heartbeats from {len(beats)} workers, expected {args.prefill + args.decode}")
    return problems + leftover


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load, warm-up included (default 300)")
    p.add_argument("--warmup-s", type=float, help="load before memory counts (default 15%% of it, 3-45 s)")
    p.add_argument("--clients", type=int, default=12, help="concurrent client loops")
    p.add_argument("--prefill", type=int, default=1)
    p.add_argument("--decode", type=int, default=1)
    p.add_argument("--model", help="checkpoint (default: the tiny qwen3_moe demo, written once)")
    p.add_argument("--max-pending-requests", type=int, default=4, help="the gateway's admission bound (429s)")
    p.add_argument("--max-backoff-s", type=float, default=2.0, help="longest wait after a 429")
    p.add_argument("--request-timeout-s", type=float, default=120.0)
    p.add_argument("--sample-s", type=float, default=2.0, help="RSS sampling interval")
    p.add_argument("--settle-s", type=float, default=45.0, help="longest wait for keys and KV to be freed")
    p.add_argument("--max-growth-mib", type=float, default=100.0)
    p.add_argument("--max-slope-mib-per-min", type=float, default=4.0)
    p.add_argument("--min-fit-s", type=float, default=60.0, help="shorter fits are reported, not judged")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "soak.json"))
    args = p.parse_args(argv)

    model = args.model or str(ensure_demo_checkpoint(REPO / "models" / "demo-tiny-qwen3_moe"))
    spec = StackSpec(model=model, port=free_port(), prefill=args.prefill, decode=args.decode, threads_per_worker=1,
                     gateway_args=("--max-pending-requests", str(args.max_pending_requests)))  # fmt: skip
    stack = Stack(spec)
    started = time.time()
    try:
        stack.start(ready_timeout_s=180)
        pids = {name: proc.pid for name, proc in stack.procs.items()} | {s.name: s.proc.pid for s in stack.infra}
        sampler = RssSampler(pids, args.sample_s)
        sampler.start()
        log(f"stack up at {stack.url}; {args.clients} clients for {args.duration:.0f} s")
        tally, phases = asyncio.run(drive(stack.url, args, sampler))
        sampler.stop()
        # leases may have to run out before nothing is left behind
        beats, keys, leftover = wait_settled(stack.nats_url, stack.redis_url, args.settle_s)
        exited = {name: proc.returncode for name, proc in stack.procs.items() if proc.poll() is not None}
    finally:
        stack.stop()
    rss = sampler.report()
    problems = verdict(tally, rss, beats, leftover, args)
    if exited:
        problems.append(f"processes exited during the soak: {exited}")
    result = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "config": {k: v for k, v in vars(args).items() if k != "out"} | {"model": os.path.basename(model)},
        "load_s": round(phases["load_end"] - phases["load_start"], 1),
        "requests": {
            "sent": tally.sent,
            "completed": tally.outcomes["completed"],
            "failed_cleanly": tally.outcomes["failed_cleanly"],
            "rejected_429": tally.rejected_429,
            "disconnected": tally.outcomes["disconnected"],
            "lost": tally.outcomes["lost"],
            "failed_by_status": dict(tally.statuses),
            "by_kind": {k: dict(v) for k, v in sorted(tally.by_kind.items())},
            "stop_mismatch": tally.outcomes["stop_mismatch"],
            "examples": tally.examples,
            "stop_prompts": phases["stop_prompts"],
        },
        "rss": rss,
        "rss_series": sampler.series()
        | {"load_start_s": sampler.offset("load_start"), "load_end_s": sampler.offset("load_end")},
        "leftover_keys": keys,
        "workers": {
            w: {
                "role": b.role,
                "integrity_error": b.integrity_error,
                "total_blocks": b.total_blocks,
                "free_blocks": b.free_blocks,
                "held_kv": b.held_kv,
            }  # fmt: skip
            for w, b in sorted(beats.items())
        },
        "ok": not problems,
        "problems": problems,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    print(summary(result))
    print(f"written: {args.out}")
    return 0 if not problems else 1


def summary(result: dict) -> str:
    r = result["requests"]
    lines = [
        f"soak: {result['load_s']:.0f} s of load after warm-up; {r['sent']} requests sent",
        f"  completed {r['completed']}, failed cleanly {r['failed_cleanly']} (429: {r['rejected_429']}), "
        f"disconnected {r['disconnected']}, lost {r['lost']}",
        f"  {'process':<12} {'start MiB':>10} {'end MiB':>10} {'max MiB':>10} {'slope MiB/min':>14}",
    ]
    for name, m in result["rss"].items():
        slope = "-" if m["slope_mib_per_min"] is None else f"{m['slope_mib_per_min']:.2f}"
        lines.append(f"  {name:<12} {m['start_mib']:>10.1f} {m['end_mib']:>10.1f} {m['max_mib']:>10.1f} {slope:>14}")
    lines.append(f"  leftover pd:* keys: {len(result['leftover_keys'])}; workers: " + ", ".join(
        f"{w} ({b['role']}) integrity {'ok' if b['integrity_error'] is None else b['integrity_error']}"
        for w, b in result["workers"].items()))  # fmt: skip
    lines.append("OK" if result["ok"] else "PROBLEMS: " + "; ".join(result["problems"]))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
