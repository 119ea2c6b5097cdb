"""The KV hand-off's share of TTFT in a `pdserve bench` run, from the decode workers' own /metrics.

Every pull a decode worker completes is one observation of `pdserve:kv_transfer_seconds{role="decode"}` (the
client's whole pull: Pull RPC + the bytes; shared/kv/transfer/client.py). The bench scrapes the URLs it is
given after its warm-ups and again after the last request, and reports the difference, in aggregate:

- kv_pulls: pulls completed during the run (one per handed-off request; a decode group's ranks pull one each;
  failed pulls, which recompute, are not in it);
- mean_kv_pull_ms: their mean duration;
- kv_pull_share_of_ttft: mean pull / mean TTFT of the run's successful requests. In pdserve the prefill worker
  streams the first token before the hand-off, so the pull is not inside the TTFT measured here: it delays
  the second token. The ratio says what the hand-off costs next to the prompt's own first-token latency
  (the share it would take of a TTFT that included it is ratio / (1 + ratio));
- kv_pull_share_of_e2el: total pull time / total E2EL of the successful requests;
- kv_bytes_pulled: KV bytes the decode workers received (`pdserve:kv_transfer_bytes_total{role="decode"}`), and
  kv_bytes_per_request: that over the run's successful requests (with a prefix cache on the decode side, the
  bytes a request's cached blocks did not have to move are missing from it).

Pulls by anyone else's requests during the run are counted too: run against a stack that serves only the bench.
Pure arithmetic and text parsing here; the scrape itself is `scrape_pulls` (httpx).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

METRIC = "pdserve:kv_transfer_seconds"
BYTES_METRIC = "pdserve:kv_transfer_bytes"
ROLE = "decode"


@dataclass(frozen=True)
class PullTotals:
    """Cumulative pulls of some decode workers: how many, their seconds summed, the bytes they received."""

    count: float = 0.0
    seconds: float = 0.0
    bytes: float = 0.0

    def __add__(self, other: PullTotals) -> PullTotals:
        return PullTotals(self.count + other.count, self.seconds + other.seconds, self.bytes + other.bytes)

    def __sub__(self, other: PullTotals) -> PullTotals:
        return PullTotals(self.count - other.count, self.seconds - other.seconds, self.bytes - other.bytes)


def parse_pulls(text: str) -> PullTotals:
    """The decode-side pull totals of one /metrics exposition (every model label summed); zero without any."""
    total = PullTotals()
    for family in text_string_to_metric_families(text):
        if family.name not in (METRIC, BYTES_METRIC):
            continue
        for sample in family.samples:
            if sample.labels.get("role") != ROLE:
                continue
            if sample.name == f"{METRIC}_count":
                total += PullTotals(count=sample.value)
            elif sample.name == f"{METRIC}_sum":
                total += PullTotals(seconds=sample.value)
            elif sample.name == f"{BYTES_METRIC}_total":
                total += PullTotals(bytes=sample.value)
    return total


async def scrape_pulls(http: httpx.AsyncClient, urls: Sequence[str]) -> PullTotals:
    """The pull totals over every URL (each a worker's /metrics). Raises httpx.HTTPError when one does not answer."""
    total = PullTotals()
    for url in urls:
        resp = await http.get(url)
        resp.raise_for_status()
        total += parse_pulls(resp.text)
    return total


def transfer_share(before: PullTotals, after: PullTotals, summary: dict) -> dict:
    """The kv_* keys above from two scrapes and a run's summary (mean_ttft_ms, mean_e2el_ms, completed).
    Ratios are None when there is nothing to divide (no pull, no successful request)."""
    run = after - before
    pulls = int(round(run.count))
    mean_pull_ms = run.seconds / pulls * 1e3 if pulls > 0 else None
    ttft_ms, e2el_total_ms = summary["mean_ttft_ms"], summary["mean_e2el_ms"] * summary["completed"]
    completed = summary["completed"]
    return {
        "kv_pulls": pulls,
        "mean_kv_pull_ms": mean_pull_ms,
        "kv_pull_share_of_ttft": mean_pull_ms / ttft_ms if mean_pull_ms is not None and ttft_ms > 0 else None,
        "kv_pull_share_of_e2el": run.seconds * 1e3 / e2el_total_ms if pulls > 0 and e2el_total_ms > 0 else None,
        "kv_bytes_pulled": int(round(run.bytes)),
        "kv_bytes_per_request": run.bytes / completed if completed > 0 else None,
    }
