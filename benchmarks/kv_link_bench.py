"""Does disaggregation pay on my link? KV transfer time against prefill time, per transport, prompt length and
demo shape: the break-even table.

    sudo .venv/bin/python benchmarks/kv_link_bench.py [--shapes qwen3_moe:small mixtral:tiny ...]
        [--tokens 128 512 1024 4096 16384] [--repeats 5] [--caps 25 10 1] [--out JSON]

Two processes (benchmarks/kv_link_roles.py): the prefill side prefills one prompt per length for every shape
(engine alone, timed) and serves the KV through `KvTransferServer`; a decode side pulls it with
`KvTransferClient`, once per transport:
- shared memory: both in one network namespace, the same-host path (`shared_memory=True`; the result says
  how many pulls really went through the segment);
- gloo, loopback: the same processes' namespace, socket path (`shared_memory=False`) over 127.0.0.1;
- gloo over a veth link: prefill and decode in two network namespaces joined by a veth pair
  (benchmarks/link_emulation.py), uncapped, then capped by a token bucket at each of `--caps` Gb/s. Each cap
  is checked with a plain TCP stream through it (its Gb/s is printed beside the KV figures). Only the rate
  is emulated, not latency (netem does not work here). Needs root and iproute2; otherwise skipped, saying so;
- NCCL: not run (no GPU here; a pair needs two GPUs).

TTFT of a prompt on a disaggregated deployment = its prefill time (measured here, same run, same model) +
the transfer; share = transfer / TTFT. The transfer depends only on the KV layout (layers, KV heads, head
dim, dtype), so it is measured once per distinct layout and applies to every shape with that layout.
Medians of `--repeats` pulls after one checked pull (bytes compared by hash); prefill: median of 3 up to
1k tokens, one run above. Writes JSON (default benchmarks/results/kv_link.json).

Transports are measured one after another (every length over one, then the next, minutes apart): on a shared
machine a load change between passes shows as a transport difference, so this table gives each transport's
cost against prefill, not transports against each other; `kv_transfer_bench.py` interleaves them. The
shared-memory send is one gather with the prefill process's torch threads (`--threads`, default 1), while a
gloo pull over loopback needs none (docs/journal/benchmarks.md, "Why kv_transfer_bench and kv_link_bench disagreed").
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks.link_emulation import VethLink, raw_throughput_gbps, terminate_on_signals, unavailable  # noqa: E402
from services.demo_model import write_demo_checkpoint  # noqa: E402
from shared.model.config import ARCHITECTURES  # noqa: E402

ROLES = str(REPO / "benchmarks" / "kv_link_roles.py")
LOOPBACK = "127.0.0.1"
NCCL_NOTE = "not run: no GPU here (an NCCL pair needs two GPUs)"
DEFAULT_SHAPES = ["qwen3_moe:small", *(f"{arch}:tiny" for arch in ARCHITECTURES), "qwen3_moe:tiny_mqa"]


def checkpoint(arch: str, size: str, max_len: int) -> Path:
    """The demo checkpoint with room for `max_len` positions (demo sizes stop at 2k / 8k; RoPE has no limit)."""
    out = REPO / "models" / f"linkbench-{arch}-{size}-{max_len}"
    if not (out / "tokenizer_config.json").is_file():
        print(f"writing the {size} {arch} demo checkpoint to {out} ...", file=sys.stderr, flush=True)
        write_demo_checkpoint(out, arch=arch, size=size)
        for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
            doc = json.loads((out / name).read_text())
            (out / name).write_text(json.dumps(doc | {key: max(doc[key], max_len + 16)}, indent=2))
    return out


class Role:
    """One role process (optionally inside a namespace): a JSON config in, JSON lines out."""

    def __init__(self, prefix: list[str], role: str, config: dict) -> None:
        self.proc = subprocess.Popen(
            [*prefix, sys.executable, ROLES, role], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(config) + "\n")
        self.proc.stdin.flush()

    def ask(self, config: dict) -> dict:
        """Send another config (a role that takes several) and read its answer."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(config) + "\n")
        self.proc.stdin.flush()
        return self.answer()

    def answer(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{' '.join(self.proc.args)} ended without an answer (exit {self.proc.wait()})")
        return json.loads(line)

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write("stop\n")
                self.proc.stdin.close()
                self.proc.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()


class Puller:
    """A decode process in one namespace; `pull_all` once per transport, each on a fresh client."""

    def __init__(self, prefix: list[str], served: dict, repeats: int) -> None:
        self.prefix, self.served, self.repeats = prefix, served, repeats
        self.role: Role | None = None

    def pull_all(self, transport: str, host: str, shared_memory: bool) -> dict:
        """{(layout key, tokens): result} of pulling every held KV from `host`'s servers."""
        targets = [
            dict(key=key, layout=entry["layout"], address=entry["addresses"][host], tokens=int(n), **kv)
            for key, entry in self.served["layouts"].items()
            for n, kv in entry["kv"].items()
        ]
        cfg = dict(transport=transport, shared_memory=shared_memory, repeats=self.repeats, threads=1, targets=targets)
        if self.role is None:
            self.role = Role(self.prefix, "decode", cfg)
            results = self.role.answer()["results"]
        else:
            results = self.role.ask(cfg)["results"]
        print(f"pulled over {transport}", file=sys.stderr, flush=True)
        return {(r["layout"], r["tokens"]): r for r in results}

    def stop(self) -> None:
        if self.role is not None:
            self.role.stop()


def measure(args, link: VethLink | None, skip_reason: str | None) -> dict:
    max_len = max(args.tokens)
    shapes = []
    for spec in args.shapes:
        arch, size = spec.split(":")
        shapes.append(dict(name=f"{arch}/{size}", dir=str(checkpoint(arch, size, max_len))))
    hosts = [LOOPBACK] + ([link.address("p")] if link else [])
    prefill_ns = link.exec_in("p") if link else []
    cfg = dict(shapes=shapes, lengths=args.tokens, chunk=args.chunk, threads=args.threads, hosts=hosts,
               short_repeats=3, short_max=1024)  # fmt: skip
    prefill = Role(prefill_ns, "prefill", cfg)
    transports: dict[str, dict] = {}
    links: list[dict] = []
    pullers: list[Puller] = []
    try:
        served = prefill.answer()
        pullers.append(Puller(prefill_ns, served, args.repeats))  # same namespace as the prefill side
        transports["shared memory"] = pullers[0].pull_all("shm", LOOPBACK, True)
        transports["gloo, loopback"] = pullers[0].pull_all("loopback", LOOPBACK, False)
        if link:
            pullers.append(Puller(link.exec_in("d"), served, args.repeats))  # across the veth pair
            for gbit in [None, *args.caps]:
                link.cap(gbit)
                name = f"gloo, veth {gbit:g} Gb/s" if gbit else "gloo, veth uncapped"
                raw_bytes = int(max(64e6, (gbit or 25) * 1e9 / 8 * 0.5))  # ≥ 0.5 s at the cap
                raw = raw_throughput_gbps(link, raw_bytes, sys.executable)
                links.append(dict(transport=name, cap_gbps=gbit, raw_tcp_gbps=raw, raw_bytes=raw_bytes))
                print(f"{name}: raw TCP {raw:.2f} Gb/s", file=sys.stderr, flush=True)
                transports[name] = pullers[1].pull_all(name, link.address("p"), False)
            link.cap(None)
    finally:
        for puller in pullers:
            puller.stop()
        prefill.stop()
    return dict(served=served, transports=transports, links=links, skipped=skip_reason)


def rows(measured: dict, tokens: list[int]) -> list[dict]:
    served = measured["served"]
    out = []
    for shape, key in served["shape_layout"].items():
        kv = served["layouts"][key]["kv"]
        for n in tokens:
            prefill_s = served["prefill"][shape][str(n)]
            nbytes = kv[str(n)]["bytes"]
            row = dict(shape=shape, tokens=n, kv_bytes=nbytes, bytes_per_token=nbytes / n, prefill_ms=prefill_s * 1e3)
            row["transports"] = {}
            for name, results in measured["transports"].items():
                r = results[(key, n)]
                t = r["median_s"]
                row["transports"][name] = dict(
                    transfer_ms=t * 1e3, min_ms=r["min_s"] * 1e3, gbps=nbytes * 8 / t / 1e9,
                    share_of_ttft=t / (prefill_s + t), shm_pulls=r["shm_pulls"], pulls=r["pulls"],
                )  # fmt: skip
            out.append(row)
    return out


def print_tables(table: list[dict], measured: dict) -> None:
    names = list(measured["transports"])
    for shape in dict.fromkeys(r["shape"] for r in table):
        print(f"\n{shape}: transfer ms (share of TTFT = prefill + transfer)")
        print("| tokens | KV | B/token | prefill | " + " | ".join(names) + " | NCCL |")
        print("| ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in names) + " | --- |")
        for r in (r for r in table if r["shape"] == shape):
            cells = [f"{r['tokens']}", f"{r['kv_bytes'] / 1e6:.2f} MB", f"{r['bytes_per_token']:.0f}",
                     f"{r['prefill_ms']:.0f} ms"]  # fmt: skip
            for name in names:
                t = r["transports"][name]
                cells.append(f"{t['transfer_ms']:.1f} ({t['share_of_ttft']:.1%})")
            print("| " + " | ".join(cells) + " | not run |")
    for name, results in measured["transports"].items():
        if name == "shared memory":
            shm = sum(r["shm_pulls"] for r in results.values())
            total = sum(r["pulls"] for r in results.values())
            print(f"\nshared memory: {shm} of {total} timed pulls went through the segment")
    if measured["links"]:
        print("\n| link | raw TCP stream |\n| --- | ---: |")
        for link in measured["links"]:
            print(f"| {link['transport']} | {link['raw_tcp_gbps']:.2f} Gb/s |")
    if measured["skipped"]:
        print(f"\nveth links skipped: {measured['skipped']}")
    print(f"NCCL: {NCCL_NOTE}")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="arch:size (demo sizes)")
    parser.add_argument("--tokens", type=int, nargs="+", default=[128, 512, 1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=5, help="timed pulls per (transport, layout, length)")
    parser.add_argument("--caps", type=float, nargs="*", default=[25, 10, 1], help="veth rate caps, Gb/s")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_num_batched_tokens)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of the prefill process")
    parser.add_argument("--no-veth", action="store_true", help="skip the emulated links")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "kv_link.json"))
    args = parser.parse_args()
    started = time.perf_counter()
    reason = "--no-veth" if args.no_veth else unavailable()
    link = None
    with terminate_on_signals():
        try:
            if reason is None:
                try:
                    link = VethLink.create()
                except RuntimeError as e:
                    reason = f"could not build the namespaces: {e}"
            if reason:
                print(f"veth links skipped: {reason}; measuring shared memory and loopback only", file=sys.stderr)
            measured = measure(args, link, reason)
        finally:
            if link is not None:
                link.close()
    table = rows(measured, args.tokens)
    print_tables(table, measured)
    doc = dict(
        date=datetime.now(UTC).isoformat(timespec="seconds"), cpu=cpu_model(), command=" ".join(sys.argv),
        repeats=args.repeats, chunk=args.chunk, threads=args.threads, links=measured["links"],
        veth_skipped=measured["skipped"], nccl=NCCL_NOTE, rows=table, seconds=time.perf_counter() - started,
    )  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {args.out} ({doc['seconds']:.0f} s, {doc['cpu']})")


if __name__ == "__main__":
    main()
