"""The profile file `pdserve profile` writes and `pdserve plan` reads: per worker configuration, what a prefill of
each prompt length and a decode step of each batch size and context cost on the host that measured it, and the
facts the costs depend on (CPU or GPU, torch, the model's config fingerprint, the engine's limits). Typed
msgspec structs, so a file that does not match is refused with the field that is wrong. No torch here: the
planner reads profiles without loading it.

Times are seconds. A configuration's `units` are what it occupies: CPU cores (its torch threads over all its ranks,
each rank pinned to its share) or GPUs (one per rank).
"""

from __future__ import annotations

import re
from pathlib import Path

import msgspec

FORMAT = "pdserve-profile/1"
_SPEC = re.compile(r"(?P<units>\d+)(?::tp(?P<tp>\d+))?(?::ep(?P<ep>\d+))?")


class WorkerConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One worker's shape: how many units it takes and its parallel degrees (a group of max(tp, ep) ranks)."""

    units: int
    tp: int = 1
    ep: int = 1

    def __post_init__(self) -> None:
        ranks = max(self.tp, self.ep)
        if self.units < 1 or self.tp < 1 or self.ep < 1:
            raise ValueError(f"worker config {self.name}: units, tp and ep must be at least 1")
        if self.tp not in (1, ranks) or self.ep not in (1, ranks):
            raise ValueError(f"worker config {self.name}: tp and ep are each 1 or the group size")
        if self.units % ranks:
            raise ValueError(f"worker config {self.name}: {self.units} units do not split over {ranks} ranks")

    @property
    def ranks(self) -> int:
        return max(self.tp, self.ep)

    @property
    def name(self) -> str:
        """The spec it parses from: "2", "2:tp2", "4:tp2:ep2"."""
        return f"{self.units}" + (f":tp{self.tp}" if self.tp > 1 else "") + (f":ep{self.ep}" if self.ep > 1 else "")

    @classmethod
    def parse(cls, spec: str) -> WorkerConfig:
        """ "UNITS[:tpN][:epM]", e.g. "1", "2", "2:tp2" (2 cores, two ranks of one thread)."""
        m = _SPEC.fullmatch(spec.strip())
        if m is None:
            raise ValueError(f"worker config {spec!r}: expected UNITS[:tpN][:epM], e.g. 2 or 2:tp2")
        return cls(int(m["units"]), int(m["tp"] or 1), int(m["ep"] or 1))


class PrefillPoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One prompt of `tokens` alone, from its arrival in the engine to its first token, over `steps` steps (the
    engine's chunk budget cuts a long prompt)."""

    tokens: int
    seconds: float
    steps: int


class DecodePoint(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A decode-only step of `batch` sequences whose mean context is `context` tokens: the median step time."""

    batch: int
    context: float
    step_s: float


class ConfigProfile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    config: WorkerConfig
    prefill: tuple[PrefillPoint, ...]
    decode: tuple[DecodePoint, ...]
    kv_tokens: int  # the KV pool's capacity in tokens (a decode worker's limit on what it holds)
    seconds: float = 0.0  # how long measuring it took


class EngineLimits(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The scheduler a worker runs with (EngineConfig defaults unless the profile was told otherwise): the
    simulation schedules with them."""

    max_num_seqs: int
    max_num_batched_tokens: int
    block_size: int
    max_model_len: int
    chunked_prefill: bool = True


class TransferCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """A KV pull: overhead_s + bytes x s_per_byte (the prefill path's cost model's coefficients)."""

    overhead_s: float
    s_per_byte: float
    bytes_per_token: int
    source: str = ""


class PlaneCosts(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What the serving plane adds to the engines' time: `ttft_s` to every first token (HTTP, the gateway, the job's
    publish and fetch, the token event's way back), `handoff_s` to every hand-off besides the pull's own cost (the
    decode job's publish and fetch, the Redis lookup, the import), and to every step of a worker its own time
    outside the engine, by the outputs the step gives (its loop hands each over and publishes it as a token event,
    on the worker's own cores): `worker` points (outputs, seconds), linear between them and past the last one with
    its last segment's slope, flat below the first (costs.WorkerOverhead).

    And the CPU the plane's own processes spend (gateway, NATS, Redis: `cpu_s_per_request` and `cpu_s_per_token` of
    output) and the load's client beside them (`client_cpu_s_*`, for a benchmark that runs its client on the same
    host): where they share the workers' cores, the workers step slower (cpu_share.py)."""

    ttft_s: float = 0.0
    handoff_s: float = 0.0
    worker: tuple[tuple[float, float], ...] = ()
    source: str = ""
    cpu_s_per_request: float = 0.0
    cpu_s_per_token: float = 0.0
    client_cpu_s_per_request: float = 0.0
    client_cpu_s_per_token: float = 0.0


class Host(msgspec.Struct, frozen=True):
    cpu: str
    cores: int  # logical CPUs this process could use
    device: str  # cpu | cuda
    torch: str
    python: str = ""
    gpu: str = ""
    load_average: tuple[float, float, float] | None = None  # before measuring: a shared host's noise shows here


class ModelFacts(msgspec.Struct, frozen=True):
    path: str
    model_type: str
    fingerprint: str  # sha256 of config.json, canonical: a plan warns when its profile was of another model
    params: int
    dtype: str
    kv_bytes_per_token: int


class Profile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    format: str
    created: str  # ISO 8601, UTC
    host: Host
    model: ModelFacts
    engine: EngineLimits
    transfer: TransferCosts
    plane: PlaneCosts
    configs: tuple[ConfigProfile, ...]
    grid: dict[str, list[int]] = {}  # what was asked for (prompt_lens, batches, contexts)
    notes: str = ""

    def __post_init__(self) -> None:
        if self.format != FORMAT:
            raise ValueError(f"not a {FORMAT} profile (format {self.format!r})")
        if not self.configs:
            raise ValueError("the profile has no worker configuration")
        for c in self.configs:
            if len(c.prefill) < 1 or len(c.decode) < 1:
                raise ValueError(f"config {c.config.name}: needs at least one prefill and one decode measurement")

    @property
    def unit(self) -> str:
        """What a configuration's units are: cores or GPUs."""
        return "gpus" if self.host.device.startswith("cuda") else "cores"

    def config(self, name: str) -> ConfigProfile:
        for c in self.configs:
            if c.config.name == name:
                return c
        raise ValueError(f"the profile has no config {name!r} (it has {', '.join(self.names())})")

    def names(self) -> list[str]:
        return [c.config.name for c in self.configs]


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile file (ValueError naming what is wrong)."""
    try:
        return msgspec.json.decode(Path(path).read_bytes(), type=Profile)
    except msgspec.ValidationError as exc:
        raise ValueError(f"{path}: not a valid profile: {exc}") from exc
    except msgspec.DecodeError as exc:
        raise ValueError(f"{path}: not JSON: {exc}") from exc


def profile_from_dict(data: dict) -> Profile:
    """A profile from its JSON object (already parsed), validated."""
    try:
        return msgspec.convert(data, type=Profile)
    except msgspec.ValidationError as exc:
        raise ValueError(f"not a valid profile: {exc}") from exc


def dump_profile(profile: Profile) -> bytes:
    return msgspec.json.format(msgspec.json.encode(profile), indent=1) + b"\n"
