"""Grammar engines for constrained decoding, measured side by side: compile time and per-token mask time.

    .venv/bin/pip install xgrammar==0.2.8 outlines-core==0.2.14   # compared here, not dependencies of pdserve
    .venv/bin/python benchmarks/grammar_bench.py [--out benchmarks/results/grammar_bench.json] [--big-vocab 32000]

Engines: llguidance, xgrammar, outlines-core (each skipped, with the reason, when it does not import). For each
grammar (a few JSON schemas, json_object, a regex) and each vocabulary (the demo checkpoint's 259-token byte-level
one, and a byte-level BPE trained here on local text to --big-vocab tokens: nothing is downloaded) it measures
- compile: building the engine's grammar object from the spec (fresh each time: no cache), then a matcher;
- mask: filling the next-token bitmask at every step of a valid output (the grammar's example, tokenized),
  advancing the matcher with each token; mean and p99 over the steps, in microseconds.
It also checks that each engine runs on this CPU-only torch (its bitmask tensor applied to logits on the CPU).
Prints a table and writes JSON with the CPU model.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from services.demo_model import byte_level_tokenizer

GRAMMARS: list[tuple[str, str, Any, str]] = [
    # (name, kind, spec, a valid output)
    (
        "schema_flat",
        "json",
        {
            "type": "object",
            "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "ok": {"type": "boolean"}},
            "required": ["name", "age", "ok"],
            "additionalProperties": False,
        },
        '{"name": "Ada Lovelace", "age": 36, "ok": true}',
    ),
    (
        "schema_nested",
        "json",
        {
            "type": "object",
            "properties": {
                "user": {
                    "type": "object",
                    "properties": {"id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}}},
                    "required": ["id", "tags"],
                },
                "level": {"enum": ["low", "mid", "high"]},
                "score": {"type": "number"},
            },
            "required": ["user", "level", "score"],
        },
        '{"user": {"id": 7, "tags": ["a", "bc", "def"]}, "level": "mid", "score": 3.25}',
    ),
    (
        "schema_array",
        "json",
        {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}},
                "required": ["x", "y"],
            },
        },
        '[{"x": 1, "y": 2}, {"x": 30, "y": -4}, {"x": 5, "y": 66}]',
    ),
    ("json_object", "json", {"type": "object"}, '{"a": [1, 2, {"b": null}], "c": "text"}'),
    (
        "regex_date_email",
        "regex",
        r"\d{4}-\d{2}-\d{2} [a-z]{3,10}@[a-z]{3,10}\.(com|org)",
        "2024-05-17 alice@example.org",
    ),
]


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


def big_tokenizer(vocab: int) -> Tokenizer:
    """A byte-level BPE trained on local Python sources (the stdlib's): a realistic large vocabulary."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    files = sorted(str(p) for p in Path(json.__file__).parent.parent.glob("*.py"))
    tok.train(files, trainer)
    return tok


def token_bytes(tok: Tokenizer) -> tuple[list[bytes], list[int]]:
    """Each id's bytes (ByteLevel's alphabet undone) and the special ids."""
    alphabet = {c: b for b, c in _bytes_to_unicode().items()}
    specials = [i for t, i in tok.get_vocab().items() if t.startswith("<|")]
    out = []
    for i in range(tok.get_vocab_size()):
        s = tok.id_to_token(i) or ""
        out.append(s.encode() if i in specials else bytes(alphabet[c] for c in s))
    return out, specials


def _bytes_to_unicode() -> dict[int, str]:
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


class Engine:
    name = ""

    def compile(self, kind: str, spec: Any) -> Any: ...
    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None: ...
    def advance(self, matcher: Any, token: int) -> None: ...


class LLGuidance(Engine):
    name = "llguidance"

    def __init__(self, tok: Tokenizer, eos: int) -> None:
        import llguidance

        self.llg = llguidance
        self.tok = llguidance.LLTokenizer(tok.to_str(), n_vocab=tok.get_vocab_size(), eos_token=eos)

    def compile(self, kind: str, spec: Any) -> Any:
        m = self.llg.LLMatcher
        grammar = m.grammar_from_json_schema(json.dumps(spec)) if kind == "json" else m.grammar_from_regex(spec)
        matcher = m(self.tok, grammar)
        assert not matcher.is_error(), matcher.get_error()
        return matcher

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        from llguidance.torch import fill_next_token_bitmask

        fill_next_token_bitmask(matcher, bitmask, 0)

    def advance(self, matcher: Any, token: int) -> None:
        assert matcher.consume_token(token), matcher.get_error()


class XGrammar(Engine):
    name = "xgrammar"

    def __init__(self, vocab: list[bytes], eos: int) -> None:
        import xgrammar

        self.xg = xgrammar
        info = xgrammar.TokenizerInfo(vocab, vocab_type=xgrammar.VocabType.RAW, stop_token_ids=[eos])
        self.info = info

    def compile(self, kind: str, spec: Any) -> Any:
        compiler = self.xg.GrammarCompiler(self.info, cache_enabled=False)
        if kind == "json":
            compiled = compiler.compile_json_schema(json.dumps(spec), any_whitespace=True)
        else:
            compiled = compiler.compile_regex(spec)
        return self.xg.GrammarMatcher(compiled)

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        matcher.fill_next_token_bitmask(bitmask, 0)

    def advance(self, matcher: Any, token: int) -> None:
        assert matcher.accept_token(token)


class OutlinesCore(Engine):
    name = "outlines-core"

    def __init__(self, vocab: list[bytes], specials: list[int], eos: int) -> None:
        import outlines_core

        self.oc = outlines_core
        mapping: dict[bytes, list[int]] = {}
        for i, b in enumerate(vocab):
            if i not in specials:
                mapping.setdefault(b, []).append(i)
        self.vocab = outlines_core.Vocabulary(eos, mapping)
        self.eos = eos

    def compile(self, kind: str, spec: Any) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(json.dumps(spec)) if kind == "json" else spec
        return self.oc.Guide(self.oc.Index(regex, self.vocab))

    def fill(self, matcher: Any, bitmask: torch.Tensor) -> None:
        row = bitmask[0]
        matcher.write_mask_into(row.data_ptr(), row.numel(), row.element_size())

    def advance(self, matcher: Any, token: int) -> None:
        if token != self.eos:  # a finished guide has no state after EOS: advancing would raise
            matcher.advance(token)


def measure(engine: Engine, kind: str, spec: Any, tokens: list[int], vocab: int, repeats: int) -> dict[str, Any]:
    compile_ms = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        engine.compile(kind, spec)
        compile_ms.append((time.perf_counter() - t0) * 1e3)
    matcher = engine.compile(kind, spec)
    bitmask = torch.zeros((1, (vocab + 31) // 32), dtype=torch.int32)
    mask_us = []
    for t in tokens:
        t0 = time.perf_counter()
        engine.fill(matcher, bitmask)
        mask_us.append((time.perf_counter() - t0) * 1e6)
        allowed = (bitmask[0, t // 32] >> (t % 32)) & 1
        assert allowed, f"{engine.name}: token {t} of the valid output is masked"
        engine.advance(matcher, t)
    logits = torch.randn(1, vocab)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    logits.masked_fill_(bits.view(1, -1)[:, :vocab] == 0, float("-inf"))  # runs on CPU torch
    first, rest = mask_us[0], sorted(mask_us[1:])
    mask_us.sort()
    return {
        "compile_ms": round(statistics.median(compile_ms), 3),
        "first_mask_us": round(first, 1),  # llguidance builds its lexer lazily: part of its compile cost
        "mask_us_mean": round(statistics.fmean(rest), 1),  # the steps after the first
        "mask_us_p99": round(mask_us[min(len(mask_us) - 1, int(0.99 * len(mask_us)))], 1),
        "steps": len(tokens),
    }


def engines_for(tok: Tokenizer) -> tuple[list[Engine], dict[str, str]]:
    vocab, specials = token_bytes(tok)
    eos = tok.token_to_id("<|im_end|>")
    made: list[Engine] = []
    failed: dict[str, str] = {}
    makers: list[tuple[str, Callable[[], Engine]]] = [
        ("llguidance", lambda: LLGuidance(tok, eos)),
        ("xgrammar", lambda: XGrammar(vocab, eos)),
        ("outlines-core", lambda: OutlinesCore(vocab, specials, eos)),
    ]
    for name, make in makers:
        try:
            made.append(make())
        except Exception as exc:  # an engine that does not import or build here is reported, not fatal
            failed[name] = f"{type(exc).__name__}: {exc}"
    return made, failed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="benchmarks/results/grammar_bench.json")
    ap.add_argument("--big-vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    vocabs = {"demo-259": byte_level_tokenizer(), f"bpe-{args.big_vocab}": big_tokenizer(args.big_vocab)}
    print(f"trained the big vocabulary in {time.perf_counter() - t0:.1f} s")
    rows: list[dict[str, Any]] = []
    failures: dict[str, dict[str, str]] = {}
    for vname, tok in vocabs.items():
        engines, failed = engines_for(tok)
        failures[vname] = failed
        for eng in engines:  # one-time set-up (tries, thread pools) is not any grammar's cost
            warm = eng.compile("regex", "[a-z]+")
            eng.fill(warm, torch.zeros((1, (tok.get_vocab_size() + 31) // 32), dtype=torch.int32))
        for gname, kind, spec, example in GRAMMARS:
            tokens = tok.encode(example).ids + [tok.token_to_id("<|im_end|>")]
            for eng in engines:
                try:
                    r = measure(eng, kind, spec, tokens, tok.get_vocab_size(), args.repeats)
                except Exception as exc:  # an engine that cannot do this grammar: recorded
                    r = {"error": f"{type(exc).__name__}: {exc}"[:200]}
                rows.append({"vocab": vname, "grammar": gname, "engine": eng.name, **r})
    head = f"{'vocab':<10} {'grammar':<18} {'engine':<14} {'compile ms':>11} {'1st mask us':>12} {'mask us':>9}"
    print(f"{head} {'p99 us':>9} {'steps':>6}")
    for r in rows:
        if "error" in r:
            print(f"{r['vocab']:<10} {r['grammar']:<18} {r['engine']:<14} error: {r['error'][:60]}")
            continue
        print(
            f"{r['vocab']:<10} {r['grammar']:<18} {r['engine']:<14} {r['compile_ms']:>11.3f} "
            f"{r['first_mask_us']:>12.1f} {r['mask_us_mean']:>9.1f} {r['mask_us_p99']:>9.1f} {r['steps']:>6}"
        )
    for vname, failed in failures.items():
        for name, why in failed.items():
            print(f"{vname}: {name} unavailable: {why}")
    result = {
        "cpu": cpu_model(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "rows": rows,
        "unavailable": failures,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2))
    print(f"CPU: {result['cpu']}; torch {result['torch']}; wrote {out}")


if __name__ == "__main__":
    main()
