"""pdserve against llama.cpp on CPU: prefill and decode tokens/s per weights dtype, side by side, in one run.

    .venv/bin/python benchmarks/llama_cpp_bench.py [--threads N] [--repeats N] [--model DIR] [--out JSON]
        [--pdserve-json JSON | --skip-pdserve] [--greedy-tokens N] [--llama-cpp-args "..."] [--quick]

llama.cpp is the CPU peer users compare a MoE server with. This script builds it, converts the benchmark's
checkpoint with its own converter, checks its greedy tokens against `transformers`, times it, times pdserve, and
prints one table:

- source: the `llama-cpp-python` source package (LLAMA_CPP_PYTHON, a benchmark dependency only) vendors
  llama.cpp at a pinned commit (recorded). `pip download` fetches it once into .cache/llama_cpp/ (git-ignored).
- build: llama.cpp's CMake, Release, -DGGML_NATIVE=ON (the widest ISA of this CPU, as pdserve's kernels pick),
  only the targets used (CMAKE_TARGETS); the build folder is kept per version and flags, so a second run
  builds nothing. The first build takes several minutes on 2 cores.
- model: the small qwen3_moe demo checkpoint engine_bench.py generates (or --model), converted by llama.cpp's
  `convert_hf_to_gguf.py` (with its vendored `gguf` package) to an F32 GGUF, which `llama-quantize` turns into
  BF16 and Q8_0. The converter names a BPE tokenizer's pre-tokenizer by a hash of its output on a test text,
  known only for published tokenizers; the demo's byte-level tokenizer is GPT-2's pre-tokenizer (ByteLevel
  with its regex) over 256 byte tokens, so the conversion runs with that one answer added (`_CONVERT`). No
  tokenizer is used by the measurement: both systems are fed token ids.
- greedy check: GREEDY_TOKENS tokens of a fixed prompt, argmax of the logits each step, from each GGUF through
  `llama-cpp-python`'s own ctypes binding (loaded against the built libllama, without the package's high-level
  layer) and from `transformers` in float32; it prints how many leading tokens agree. Twice per GGUF
  (GREEDY_SETTINGS): with exact attention (flash attention off, float32 KV cache), where the F32 GGUF must
  write transformers' tokens (else the conversion is wrong and the run stops), and with llama.cpp's defaults
  (flash attention "auto", which is on for CPU, and a float16 KV cache), the settings it is timed with. The
  defaults part sooner: the flash-attention path of a one-token decode rounds Q to float16, and on the demo's
  random weights a router's near tie then picks another expert (measured: logits 1.77 apart at the third
  generated token, against 2e-5 with exact attention). BF16 and Q8_0 may part on a near tie in either case.
- llama.cpp timing: `llama-batched-bench -npp 128 -ntg 128 -npl 1,8,32` (decode: S_TG, the generated tokens
  of all sequences over the decode time) and `-npp 512 -ntg 1 -npl 1` (prefill: S_PP), at --threads for both
  -t and -tb; each run repeated --repeats times, the median per row. Its defaults (flash attention auto, float16
  KV cache) are kept, as users run it, and recorded; --llama-cpp-args adds flags, e.g. "-fa off -ctk f32 -ctv f32".
- a GGUF llama.cpp crashes on with its weight repacking (its "extra buffer types": on an Intel host with AMX,
  Q8_0 matmuls go to the AMX path, which at 0c1e570 segfaults in ggml_backend_amx_mul_mat on the demo's shapes)
  runs with repacking off (`-nr`, use_extra_bufts = false), found by a short smoke run per GGUF; the JSON and
  the table's row say so. That path is llama.cpp's generic one, likely slower than a working AMX one.
- pdserve timing: `benchmarks/engine_bench.py --threads N --skip-mixed` in a child process (its medians of
  interleaved repeats against transformers): prefill = its batch-1 prefill of 512 tokens, decode = its decode
  of 128-token prompts, 128 timed tokens, at 1, 8 and 32 sequences. Per weights dtype when engine_bench.py
  all weights dtypes in one run (`--dtype float32,bfloat16,int8`, systems named `<system>@<dtype>`) where its
  --dtype offers them; a tree whose engine_bench.py has no --dtype runs float32 only, the other rows say so.

The two systems run one after the other, not interleaved: on a shared host, compare ratios from one quiet run.
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.machinery
import importlib.util
import json
import os
import re
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))  # run as a script from anywhere, installed or not

LLAMA_CPP_PYTHON = "0.3.36"  # the source package, hence the llama.cpp commit, the table was measured with
CACHE = REPO / ".cache" / "llama_cpp"
# shared libraries: the greedy check loads libllama through ctypes
CMAKE_FLAGS = ("-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
               "-DBUILD_SHARED_LIBS=ON")  # fmt: skip
CMAKE_TARGETS = ("llama", "llama-batched-bench", "llama-quantize")

# weights dtype (the table's rows) → llama.cpp's GGUF type; F32 comes from the converter, the others from it
GGUF_TYPES = {"float32": "F32", "bfloat16": "BF16", "int8": "Q8_0"}
WEIGHTS_SEPARATOR = "@"  # engine_bench.py's system names with --dtype: <system>@<weights dtype>

# the shapes engine_bench.py measures (checked against its JSON)
PREFILL_LEN, DECODE_PROMPT, DECODE_TOKENS, DECODE_BATCHES = 512, 128, 128, (1, 8, 32)
GREEDY_TOKENS = 32
# name → llama_context_params fields for the greedy check (ggml type 0 = F32; flash_attn_type 0 = off, -1 = auto)
GREEDY_SETTINGS = {"exact": dict(flash_attn_type=0, type_k=0, type_v=0), "defaults": {}}
GREEDY_PROMPT = "The benchmark's fixed prompt: a mixture of experts routes each token to two of eight."
NOT_IN_TREE = "not in this tree"
FLASH_ATTN = {-1: "auto", 0: "off", 1: "on"}  # llama-batched-bench's settings line prints the enum

# convert_hf_to_gguf.py, for a byte-level BPE tokenizer without merges (the demo's: 256 byte tokens, GPT-2's
# ByteLevel pre-tokenizer with its regex, three specials), with two answers added that published tokenizers do not
# need: (1) the pre-tokenizer's name, "gpt-2": the converter knows pre-tokenizers by a hash of their output on a
# test text, listed for published tokenizers only; (2) one inert merge: llama.cpp refuses a BPE vocab without a
# merges list and the GGUF writer refuses an empty list, so the list holds "<|endoftext|> <|endoftext|>", a pair
# that never occurs (BPE starts from single characters and no other merge builds a longer symbol), so llama.cpp
# tokenizes text as before. Any other tokenizer converts (or fails) exactly as without this wrapper.
_CONVERT = """
import json, runpy, sys
from pathlib import Path
llama_cpp_dir, model_dir = Path(sys.argv[1]), Path(sys.argv[2])
sys.path[:0] = [str(llama_cpp_dir), str(llama_cpp_dir / "gguf-py")]
import gguf
from conversion import base
tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
pre, bpe = tokenizer.get("pre_tokenizer") or {}, tokenizer.get("model") or {}
byte_level = pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and bpe.get("type") == "BPE"
if byte_level:
    known_pre = base.TextModel.get_vocab_base_pre
    def get_vocab_base_pre(self, tokenizer):
        try:
            return known_pre(self, tokenizer)
        except NotImplementedError:
            return "gpt-2"
    base.TextModel.get_vocab_base_pre = get_vocab_base_pre
if byte_level and not bpe.get("merges"):
    add_to_gguf = gguf.SpecialVocab.add_to_gguf
    def add_inert_merge(self, gw, quiet=False):
        if self.load_merges and not self.merges:
            self.merges = ["<|endoftext|> <|endoftext|>"]
        return add_to_gguf(self, gw, quiet)
    gguf.SpecialVocab.add_to_gguf = add_inert_merge
sys.argv = [str(llama_cpp_dir / "convert_hf_to_gguf.py")] + sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# ---------------------------------------------------------------------------------------------- pure parts


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|" + r"\s*([\d.]+)\s*\|" * 6 + r"\s*$", re.M)
_ROW_FIELDS = ("pp", "tg", "b", "n_kv", "t_pp", "s_pp", "t_tg", "s_tg", "t", "s")
_SETTINGS = re.compile(r"(\w+) = (-?\d+)")


def parse_batched_bench(text: str) -> tuple[dict[str, int], list[dict[str, float]]]:
    """llama-batched-bench's output → (its settings line, e.g. n_threads and flash_attn; one dict per table row
    with PP, TG, B, N_KV, the times in s and the speeds in tokens/s under _ROW_FIELDS' names)."""
    settings: dict[str, int] = {}
    rows = []
    for line in text.splitlines():
        if "n_kv_max =" in line:
            settings = {k: int(v) for k, v in _SETTINGS.findall(line)}
        elif m := _ROW.match(line.strip()):
            row = dict(zip(_ROW_FIELDS, (float(g) for g in m.groups()), strict=True))
            rows.append(row | {k: int(row[k]) for k in ("pp", "tg", "b", "n_kv")})
    if not rows:
        raise ValueError("no result rows in llama-batched-bench's output")
    return settings, rows


def median_rows(runs: Sequence[Sequence[dict[str, float]]]) -> list[dict[str, Any]]:
    """Repeated runs of one batched-bench command → one row per (pp, tg, b): each field's median, plus the
    per-run speeds (s_pp_runs, s_tg_runs)."""
    keys = [(r["pp"], r["tg"], r["b"]) for r in runs[0]]
    out = []
    for key in keys:
        same = [r for run in runs for r in run if (r["pp"], r["tg"], r["b"]) == key]
        if len(same) != len(runs):
            raise ValueError(f"row {key} is missing from some runs")
        row: dict[str, Any] = {f: statistics.median(r[f] for r in same) for f in _ROW_FIELDS}
        row |= dict(pp=key[0], tg=key[1], b=key[2], s_pp_runs=[r["s_pp"] for r in same],
                    s_tg_runs=[r["s_tg"] for r in same])  # fmt: skip
        out.append(row)
    return out


def llama_cpp_figures(prefill_rows: list[dict], decode_rows: list[dict]) -> dict[str, float | None]:
    """The table's cells from batched-bench rows: prefill = S_PP of one PREFILL_LEN prompt, decode at B
    sequences = S_TG of the DECODE_PROMPT/DECODE_TOKENS row with that B."""
    pre = [r["s_pp"] for r in prefill_rows if r["pp"] == PREFILL_LEN and r["b"] == 1]
    out: dict[str, float | None] = dict(prefill=pre[0] if pre else None)
    for b in DECODE_BATCHES:
        dec = [r["s_tg"] for r in decode_rows if (r["pp"], r["tg"], r["b"]) == (DECODE_PROMPT, DECODE_TOKENS, b)]
        out[f"decode_{b}"] = dec[0] if dec else None
    return out


def pdserve_system(systems: Sequence[str], dtype: str) -> str | None:
    """engine_bench.py's headline pdserve system for a weights dtype: the first `<system>@<dtype>`; in a run
    without --dtype (no `@`), the first system for float32 (the checkpoint's dtype); else None."""
    pds = [s for s in systems if s != "transformers"]
    if any(WEIGHTS_SEPARATOR in s for s in pds):
        return next((s for s in pds if s.partition(WEIGHTS_SEPARATOR)[2] == dtype), None)
    return pds[0] if pds and dtype == "float32" else None


def pdserve_figures(report: dict, dtype: str = "float32") -> dict[str, float | None]:
    """The table's cells from an engine_bench.py JSON: the weights dtype's headline pdserve system's batch-1
    prefill and its decode rows. A shape other than this script's is an error (the columns would not mean the
    same), and so is a JSON without the dtype."""
    cfg = report["config"]
    shapes = (cfg["prefill_len"], cfg["decode_prompt_len"], cfg["decode_tokens"])
    if shapes != (PREFILL_LEN, DECODE_PROMPT, DECODE_TOKENS):
        raise ValueError(f"engine_bench ran prefill/prompt/tokens {shapes}, this table is for "
                         f"{(PREFILL_LEN, DECODE_PROMPT, DECODE_TOKENS)}")  # fmt: skip
    system = pdserve_system(cfg["systems"], dtype)
    if system is None:
        raise ValueError(f"engine_bench ran no pdserve system with {dtype} weights: {cfg['systems']}")
    pre = [r[f"{system}_tok_s"] for r in report["prefill"] if r["batch"] == 1]
    out: dict[str, float | None] = dict(prefill=pre[0] if pre else None)
    for b in DECODE_BATCHES:
        dec = [r[f"{system}_tok_s"] for r in report["decode"] if r["batch"] == b]
        out[f"decode_{b}"] = dec[0] if dec else None
    return out


def agreement(reference: Sequence[int], tokens: Sequence[int]) -> dict[str, Any]:
    """How far two greedy continuations agree: leading tokens equal, and all positions equal."""
    n = min(len(reference), len(tokens))
    lead = next((i for i in range(n) if reference[i] != tokens[i]), n)
    same = sum(a == b for a, b in zip(reference[:n], tokens[:n], strict=True))
    return dict(tokens=len(reference), leading_same=lead, same=same, identical=list(reference) == list(tokens))


COLUMNS = ("prefill", *(f"decode_{b}" for b in DECODE_BATCHES))


def table_rows(figures: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """figures: dtype → {"llama.cpp": cells, "pdserve": cells or a reason it has none, optionally "llama.cpp
    flags": what llama.cpp ran with beyond its defaults} → rows of the table, each dtype's two systems then
    pdserve / llama.cpp (a reason string fills a row's cells)."""
    rows = []
    for dtype, systems in figures.items():
        peer, ours = systems["llama.cpp"], systems["pdserve"]
        notes = [GGUF_TYPES[dtype]] if GGUF_TYPES.get(dtype) not in (None, "F32") else []
        notes += [systems["llama.cpp flags"]] if systems.get("llama.cpp flags") else []
        peer_name = "llama.cpp" + (f" ({', '.join(notes)})" if notes else "")
        rows.append(dict(weights=dtype, system=peer_name, cells=peer))
        rows.append(dict(weights=dtype, system="pdserve", cells=ours))
        if isinstance(peer, dict) and isinstance(ours, dict):
            ratio = {c: ours[c] / peer[c] if ours.get(c) and peer.get(c) else None for c in COLUMNS}
            rows.append(dict(weights=dtype, system="pdserve / llama.cpp", cells=ratio, ratio=True))
    return rows


def render_table(rows: list[dict[str, Any]]) -> str:
    """The issue's markdown table: tokens/s, a ratio row as `1.23x`, a missing cell as `-`, a row without
    figures as its reason."""
    head = "| weights | system | prefill (512) | " + " | ".join(
        f"decode, {b} seq{'s' if b > 1 else ''}" for b in DECODE_BATCHES
    )
    lines = [head + " |", "| --- | --- |" + " ---: |" * len(COLUMNS)]
    for row in rows:
        cells = row["cells"]
        if isinstance(cells, str):
            shown = [cells] + [""] * (len(COLUMNS) - 1)
        else:
            fmt = "{:.2f}x" if row.get("ratio") else "{:.0f}"
            shown = ["-" if cells.get(c) is None else fmt.format(cells[c]) for c in COLUMNS]
        lines.append(f"| {row['weights']} | {row['system']} | " + " | ".join(shown) + " |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- llama.cpp


def ensure_source(version: str = LLAMA_CPP_PYTHON, cache: Path = CACHE) -> Path:
    """The unpacked `llama-cpp-python` source package (downloaded once with pip) → its vendored llama.cpp."""
    root = cache / f"llama_cpp_python-{version}"
    if not (root / "vendor" / "llama.cpp" / "CMakeLists.txt").is_file():
        sdist = cache / f"llama_cpp_python-{version}.tar.gz"
        if not sdist.is_file():
            cache.mkdir(parents=True, exist_ok=True)
            print(f"downloading llama-cpp-python {version} (source) into {cache} ...", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "download", f"llama-cpp-python=={version}", "--no-deps",
                            "--no-binary", ":all:", "-d", str(cache)], check=True)  # fmt: skip
        with tarfile.open(sdist) as tar:
            tar.extractall(cache, filter="data")
    return root / "vendor" / "llama.cpp"


def llama_cpp_commit(llama_cpp_dir: Path) -> str | None:
    """The vendored llama.cpp's commit: the source package keeps the submodule's git HEAD."""
    head = llama_cpp_dir.parent.parent / ".git" / "modules" / "vendor" / "llama.cpp" / "HEAD"
    return head.read_text().strip() if head.is_file() else None


def ensure_build(llama_cpp_dir: Path, version: str = LLAMA_CPP_PYTHON, cache: Path = CACHE) -> Path:
    """Configure and build CMAKE_TARGETS once per version and flags (a stamp file says which); → bin folder."""
    build = cache / f"build-{version}"
    stamp, wanted = build / "pdserve-build-stamp.json", dict(flags=CMAKE_FLAGS, targets=CMAKE_TARGETS)
    bins = [build / "bin" / t for t in CMAKE_TARGETS if t.startswith("llama-")]
    if (
        stamp.is_file()
        and json.loads(stamp.read_text()) == json.loads(json.dumps(wanted))
        and all(b.is_file() for b in bins)
    ):
        return build / "bin"
    print(f"building llama.cpp {CMAKE_TARGETS} in {build} (several minutes the first time) ...", flush=True)
    t0 = time.perf_counter()
    subprocess.run(["cmake", "-S", str(llama_cpp_dir), "-B", str(build), *CMAKE_FLAGS], check=True)
    jobs = str(len(os.sched_getaffinity(0)))
    subprocess.run(["cmake", "--build", str(build), "-j", jobs, "--target", *CMAKE_TARGETS], check=True)
    stamp.write_text(json.dumps(wanted))
    print(f"built in {time.perf_counter() - t0:.0f} s", flush=True)
    return build / "bin"


def _fresh(path: Path, source: Path) -> bool:
    return path.is_file() and path.stat().st_mtime >= source.stat().st_mtime


def ensure_ggufs(model_dir: Path, llama_cpp_dir: Path, bin_dir: Path, out_dir: Path) -> dict[str, Path]:
    """GGUFs of the checkpoint per weights dtype, made once (again when the checkpoint is newer)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    weights = max((model_dir / f for f in os.listdir(model_dir) if f.endswith(".safetensors")), key=os.path.getmtime)
    paths = {dtype: out_dir / f"{t.lower()}.gguf" for dtype, t in GGUF_TYPES.items()}
    f32 = paths["float32"]
    if not _fresh(f32, weights):
        print(f"converting {model_dir} to {f32} with llama.cpp's convert_hf_to_gguf.py ...", flush=True)
        cmd = [sys.executable, "-c", _CONVERT, str(llama_cpp_dir), str(model_dir), "--outtype", "f32",
               "--outfile", str(f32)]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True)  # it prints the chat template
        (out_dir / "convert.log").write_text(done.stdout + done.stderr)
        if done.returncode != 0:
            sys.exit(f"convert_hf_to_gguf.py failed:\n{(done.stdout + done.stderr)[-3000:]}")
    for dtype, path in paths.items():
        if dtype != "float32" and not _fresh(path, f32):
            subprocess.run([str(bin_dir / "llama-quantize"), str(f32), str(path), GGUF_TYPES[dtype]], check=True,
                           capture_output=True)  # fmt: skip
    return paths


class LlamaCppBinding:
    """The source package's low-level ctypes binding (llama_cpp/llama_cpp.py), bound to the libllama just built.
    Only that module is loaded: the package's __init__ pulls in its high-level layer and that one's
    dependencies, which a greedy loop does not need."""

    def __init__(self, llama_cpp_dir: Path, bin_dir: Path) -> None:
        package_dir = llama_cpp_dir.parent.parent / "llama_cpp"
        os.environ["LLAMA_CPP_LIB_PATH"] = str(bin_dir)
        if "llama_cpp" not in sys.modules:  # a bare package object: its submodules import, its __init__ doesn't
            spec = importlib.machinery.ModuleSpec("llama_cpp", None, is_package=True)
            package = importlib.util.module_from_spec(spec)
            package.__path__ = [str(package_dir)]
            sys.modules["llama_cpp"] = package
        import llama_cpp.llama_cpp as lib  # after the bare package above

        self.lib = lib
        self.log: list[str] = []  # llama.cpp's log, shown only when a load fails
        self._log_to_list = lib.llama_log_callback(lambda level, text, user_data: self.log.append(text.decode()))
        lib.llama_log_set(self._log_to_list, ctypes.c_void_p())  # the callback stays referenced: C holds it
        lib.llama_backend_init()

    def greedy(
        self,
        gguf: Path,
        prompt: Sequence[int],
        new_tokens: int,
        threads: int,
        settings: dict[str, int],
        no_repack: bool = False,
    ) -> list[int]:
        """The argmax token of each step's logits, `new_tokens` times after the prompt; `settings`: context
        parameters over llama.cpp's defaults; no_repack: weights without the extra buffer types (= -nr)."""
        import numpy as np

        lib = self.lib
        self.log.clear()
        model_params = lib.llama_model_default_params()
        model_params.use_extra_bufts = not no_repack
        model = lib.llama_model_load_from_file(str(gguf).encode(), model_params)
        if not model:
            raise RuntimeError(f"llama.cpp could not load {gguf}:\n{''.join(self.log)[-3000:]}")
        params = lib.llama_context_default_params()
        params.n_ctx = params.n_batch = len(prompt) + new_tokens + 1
        params.n_threads = params.n_threads_batch = threads
        for field, value in settings.items():
            setattr(params, field, value)
        ctx = lib.llama_init_from_model(model, params)
        try:
            n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
            batch = (lib.llama_token * len(prompt))(*prompt)
            out: list[int] = []
            for _ in range(new_tokens):
                if lib.llama_decode(ctx, lib.llama_batch_get_one(batch, len(batch))) != 0:
                    raise RuntimeError("llama_decode failed")
                logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, -1), shape=(n_vocab,))
                out.append(int(logits.argmax()))
                batch = (lib.llama_token * 1)(out[-1])
            return out
        finally:
            lib.llama_free(ctx)
            lib.llama_model_free(model)


def batched_bench(
    bin_dir: Path, gguf: Path, threads: int, npp: int, ntg: int, npl: Sequence[int], extra: Sequence[str] = ()
) -> str:
    """One llama-batched-bench run → its stdout (the settings line and the table). Its log is written by a
    thread of its own, and on a loaded host a run has exited (status 0) before printing all its rows: one
    printed the header and no row, one its rows but the last; so a run short of a row per -npl is tried again
    (twice at most), and the caller's parse finds what is still missing."""
    ctx = max(npl) * (npp + ntg)  # every sequence its own prompt (no -pps)
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
           "-c", str(ctx), "-npp", str(npp), "-ntg", str(ntg), "-npl", ",".join(map(str, npl)), *extra]  # fmt: skip
    for _ in range(3):
        done = subprocess.run(cmd, check=True, capture_output=True, text=True)
        if len(_ROW.findall(done.stdout)) >= len(npl):
            break
    return done.stdout


def needs_no_repack(bin_dir: Path, gguf: Path, threads: int) -> bool:
    """Whether llama.cpp crashes on this GGUF with weight repacking on and runs with it off (-nr): a short
    batched-bench run each way. Raises if it fails either way."""
    cmd = [str(bin_dir / "llama-batched-bench"), "-m", str(gguf), "-t", str(threads), "-tb", str(threads),
           "-c", "64", "-npp", "16", "-ntg", "2", "-npl", "1"]  # fmt: skip
    if subprocess.run(cmd, capture_output=True).returncode == 0:
        return False
    if subprocess.run([*cmd, "-nr"], capture_output=True).returncode == 0:
        return True
    raise RuntimeError(f"llama.cpp fails on {gguf} with and without weight repacking: {' '.join(cmd)}")


def time_llama_cpp(bin_dir: Path, gguf: Path, threads: int, repeats: int, extra: Sequence[str] = ()) -> dict:
    """Prefill and decode rows of one GGUF, each command repeated `repeats` times (medians), and the raw
    outputs."""
    runs: dict[str, list] = dict(prefill=[], decode=[])
    outputs = []
    settings: dict[str, int] = {}
    for _ in range(repeats):
        for phase, (npp, ntg, npl) in dict(prefill=(PREFILL_LEN, 1, (1,)),
                                           decode=(DECODE_PROMPT, DECODE_TOKENS, DECODE_BATCHES)).items():  # fmt: skip
            outputs.append(batched_bench(bin_dir, gguf, threads, npp, ntg, npl, extra))
            settings, rows = parse_batched_bench(outputs[-1])
            runs[phase].append(rows)
    prefill, decode = median_rows(runs["prefill"]), median_rows(runs["decode"])
    figures = llama_cpp_figures(prefill, decode)
    return dict(settings=settings, prefill_rows=prefill, decode_rows=decode, figures=figures, outputs=outputs)


# ---------------------------------------------------------------------------------------------- pdserve, transformers


def hf_greedy(model_dir: Path, prompt: Sequence[int], new_tokens: int, dtype: str = "float32") -> list[int]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype)).eval()
    model.generation_config.eos_token_id = None  # as ignore_eos: always new_tokens tokens
    ids = torch.tensor([list(prompt)])
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=0)  # fmt: skip
    return out[0, ids.shape[1] :].tolist()


def engine_bench_dtypes() -> list[str]:
    """The weights dtypes (GGUF_TYPES' order) engine_bench.py in this tree runs with --dtype, as its --help names
    them; empty when it has no --dtype."""
    help_text = subprocess.run([sys.executable, str(REPO / "benchmarks" / "engine_bench.py"), "--help"],
                               check=True, capture_output=True, text=True).stdout  # fmt: skip
    if "--dtype" not in help_text:
        return []
    return [d for d in GGUF_TYPES if re.search(rf"\b{re.escape(d)}\b", help_text.partition("--dtype")[2])]


def run_engine_bench(dtypes: Sequence[str], threads: int, out: Path, quick: bool) -> dict:
    """engine_bench.py, all `dtypes` side by side in one run (none: without --dtype, the checkpoint's float32)."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "engine_bench.py"), "--threads", str(threads), "--skip-mixed",
           "--out", str(out)]  # fmt: skip
    cmd += (["--dtype", ",".join(dtypes)] if dtypes else []) + (["--quick"] if quick else [])
    print(f"\n$ {' '.join(cmd)}", flush=True)
    subprocess.run(cmd, check=True)
    return json.loads(out.read_text())


# ---------------------------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="checkpoint directory (default: the small qwen3_moe demo engine_bench.py uses)")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "llama_cpp_bench.json"))
    ap.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    ap.add_argument("--repeats", type=int, default=3, help="llama-batched-bench runs per GGUF and command (median)")
    ap.add_argument("--greedy-tokens", type=int, default=GREEDY_TOKENS)
    ap.add_argument("--pdserve-json", metavar="JSON", help="an engine_bench.py JSON to use instead of running it")
    ap.add_argument("--skip-pdserve", action="store_true", help="llama.cpp only")
    ap.add_argument("--llama-cpp-args", default="", help='flags added to llama-batched-bench, e.g. "-fa off"')
    ap.add_argument("--quick", action="store_true", help="one repeat here, engine_bench.py --quick (no 8 seqs)")
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats

    import torch  # here: the pure parts above import without torch

    from benchmarks.engine_bench import prepare_model
    from benchmarks.host_info import cpu_info, describe, load_average

    torch.set_num_threads(args.threads)
    load_before = load_average()
    started = time.perf_counter()
    llama_cpp_dir = ensure_source()
    commit = llama_cpp_commit(llama_cpp_dir)
    bin_dir = ensure_build(llama_cpp_dir)
    model_dir = prepare_model(args.model)
    ggufs = ensure_ggufs(model_dir, llama_cpp_dir, bin_dir, REPO / "models" / "gguf" / model_dir.name)

    no_repack = {dtype: needs_no_repack(bin_dir, path, args.threads) for dtype, path in ggufs.items()}
    for dtype in (d for d, off in no_repack.items() if off):
        print(f"llama.cpp crashes on the {GGUF_TYPES[dtype]} GGUF with weight repacking: it runs with -nr")

    # greedy tokens: each GGUF against transformers in float32
    from transformers import AutoTokenizer

    prompt = AutoTokenizer.from_pretrained(model_dir)(GREEDY_PROMPT)["input_ids"]
    reference = hf_greedy(model_dir, prompt, args.greedy_tokens)
    # how soon rounding the weights alone parts greedy tokens on this checkpoint: transformers against itself
    hf_bf16 = agreement(reference, hf_greedy(model_dir, prompt, args.greedy_tokens, "bfloat16"))
    print(
        f"greedy, transformers bfloat16 vs float32: {hf_bf16['leading_same']}/{hf_bf16['tokens']} leading tokens "
        f"agree, {hf_bf16['same']}/{hf_bf16['tokens']} positions"
    )
    binding = LlamaCppBinding(llama_cpp_dir, bin_dir)
    greedy: dict[str, dict] = {name: {} for name in GREEDY_SETTINGS}
    for name, settings in GREEDY_SETTINGS.items():
        for dtype, path in ggufs.items():
            tokens = binding.greedy(path, prompt, args.greedy_tokens, args.threads, settings, no_repack[dtype])
            g = greedy[name][dtype] = agreement(reference, tokens) | dict(generated=tokens)
            print(
                f"greedy, {name} attention settings: {GGUF_TYPES[dtype]:>5} vs transformers float32: "
                f"{g['leading_same']}/{g['tokens']} leading tokens agree, {g['same']}/{g['tokens']} positions"
            )
    if not greedy["exact"]["float32"]["identical"]:
        sys.exit("llama.cpp's F32 GGUF does not write transformers' greedy tokens: the conversion is not faithful")

    llama_cpp, extra_args = {}, {}
    for dtype, path in ggufs.items():
        print(f"timing llama.cpp {GGUF_TYPES[dtype]} ({repeats} x 2 batched-bench runs) ...", flush=True)
        extra = extra_args[dtype] = args.llama_cpp_args.split() + (["-nr"] if no_repack[dtype] else [])
        llama_cpp[dtype] = time_llama_cpp(bin_dir, path, args.threads, repeats, extra) | dict(
            no_repack=no_repack[dtype]
        )

    if args.pdserve_json:
        engine_report: dict | None = json.loads(Path(args.pdserve_json).read_text())
    elif args.skip_pdserve:
        engine_report = None
    else:
        offered = engine_bench_dtypes()
        out = Path(args.out).with_name("llama_cpp_bench.engine_bench.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        engine_report = run_engine_bench(offered, args.threads, out, args.quick)
    pdserve: dict[str, dict | str] = {}
    for dtype in GGUF_TYPES:
        system = engine_report and pdserve_system(engine_report["config"]["systems"], dtype)
        if engine_report is None:
            pdserve[dtype] = "skipped (--skip-pdserve)"
        elif system is None:
            pdserve[dtype] = NOT_IN_TREE
            print(f"TODO: pdserve {dtype}: engine_bench.py ran no {dtype} system (no `--dtype {dtype}` in this "
                  "tree?); its row stays empty until it does")  # fmt: skip
        else:
            pdserve[dtype] = pdserve_figures(engine_report, dtype)
    figures = {
        dtype: {
            "llama.cpp": llama_cpp[dtype]["figures"],
            "llama.cpp flags": " ".join(extra_args[dtype]),
            "pdserve": p,
        }
        for dtype, p in pdserve.items()
    }
    rows = table_rows(figures)

    host = cpu_info() | dict(load_before=load_before, load_after=load_average())
    settings = llama_cpp["float32"]["settings"]
    flash_attn = FLASH_ATTN.get(settings.get("flash_attn"), settings.get("flash_attn"))
    print(
        f"\npdserve vs llama.cpp {commit[:7] if commit else '?'} (llama-cpp-python {LLAMA_CPP_PYTHON}), tokens/s; "
        f"{describe(host)}; llama.cpp flash_attn={flash_attn}, n_threads={settings.get('n_threads')}; "
        f"load average {load_before[0]:.1f} before, {host['load_after'][0]:.1f} after\n"
    )
    print(render_table(rows))
    report = dict(
        timestamp=datetime.now(UTC).isoformat(timespec="seconds"),
        host=host,
        threads=args.threads,
        llama_cpp=dict(
            package=f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
            commit=commit,
            cmake_flags=CMAKE_FLAGS,
            batched_bench_args=args.llama_cpp_args,
            ggufs={d: str(p) for d, p in ggufs.items()},
            runs=llama_cpp,
        ),
        greedy=dict(prompt=prompt, reference=reference, agreement=greedy, transformers_bfloat16=hf_bf16),
        engine_bench=engine_report and {k: engine_report[k] for k in ("config", "prefill", "decode")},
        figures=figures,
        table=render_table(rows),
        bench_seconds=time.perf_counter() - started,
    )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out} ({report['bench_seconds']:.0f} s)")


if __name__ == "__main__":
    main()
