"""Constrained decoding in the engine, on the random demo model: what it writes follows the schema / regex /
choice, greedy and sampled; the mask at each step is exactly the grammar engine's allowed set; a request that
moves (KV hand-off, migration with tokens so far) continues identically, its matcher rebuilt by replaying."""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch

from services.demo_model import write_demo_checkpoint
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.engine.structured import StructuredDecoding, apply_bitmask
from shared.model.tokenizer import Tokenizer
from shared.structured import spec as specs
from shared.structured.grammar import GrammarError, Grammars
from tests.structured_cases import CHOICES, MAX_TOKENS, REGEXES, SCHEMAS


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_demo_checkpoint(tmp_path_factory.mktemp("structured"), arch="qwen3_moe", size="tiny")


@pytest.fixture(scope="module")
def engine(model_dir):
    return Engine.from_dir(model_dir, max_model_len=1024)


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(model_dir)


def _prompt(tok: Tokenizer, text: str = "Write JSON") -> list[int]:
    return tok.encode_chat([{"role": "user", "content": text}])


def _run(engine: Engine, tok: Tokenizer, spec, temperature: float, seed: int = 3) -> tuple[str, list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=seed, structured=spec)
    out = engine.generate([_prompt(tok)], params)[0]
    assert out[-1] in tok.eos_token_ids, "the grammar completed, so the model ended with EOS within the budget"
    return tok.decode(out), out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_json_schema_output_validates(engine, tok, name, temperature):
    text, _ = _run(engine, tok, specs.json_schema(SCHEMAS[name]), temperature)
    jsonschema.validate(json.loads(text), SCHEMAS[name])


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_object_parses(engine, tok, temperature):
    text, _ = _run(engine, tok, specs.JSON_OBJECT, temperature)
    assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("pattern", REGEXES)
def test_regex_output_matches(engine, tok, pattern, temperature):
    text, _ = _run(engine, tok, specs.regex(pattern), temperature)
    assert re.fullmatch(pattern, text), text


@pytest.mark.parametrize("options", CHOICES)
def test_choice_output_is_one_of_them(engine, tok, options):
    for seed in range(3):
        text, _ = _run(engine, tok, specs.choice(options), 1.0, seed=seed)
        assert text in options


def test_unconstrained_rows_are_untouched(engine, tok):
    """One batch: a constrained and a free request; the free one writes what it writes alone."""
    free = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    alone = engine.generate([_prompt(tok, "free")], free)[0]
    engine.add_request("c", _prompt(tok), SamplingParams(max_tokens=40, temperature=0.0, structured=specs.JSON_OBJECT))
    engine.add_request("f", _prompt(tok, "free"), free)
    got: dict[str, list[int]] = {"c": [], "f": []}
    while engine.has_unfinished():
        for o in engine.step():
            got[o.request_id] += o.new_token_ids
    assert got["f"] == alone
    assert json.loads(tok.decode(got["c"])) == {}


def test_mask_is_the_grammar_engines_allowed_set(model_dir, tok):
    """At each step of a valid output, the logits left finite by the mask are exactly the tokens llguidance says
    may come next (asked one token at a time, not through the bitmask); EOS only where the grammar accepts."""
    grammars = Grammars(tok.to_json(), tok.vocab_size, tok.eos_token_ids)
    structured = StructuredDecoding(lambda: grammars)
    spec = specs.json_schema(SCHEMAS["flat"])
    text = '{"name": "Ada", "age": 36, "ok": true}'
    tokens = tok.encode(text, add_special_tokens=False) + [tok.eos_token_ids[0]]
    reference = grammars.matcher(spec)
    structured.add("r", spec, [])
    vocab = tok.vocab_size
    for step, t in enumerate(tokens):
        pending = structured.begin(["other", "r"])
        logits = structured.apply(pending, torch.zeros(2, vocab))
        masked = {i for i in range(vocab) if torch.isfinite(logits[1, i])}
        eos = tok.eos_token_ids[0]
        expected = {i for i in range(vocab) if i != eos and reference.validate_tokens([i]) == 1}
        assert masked - {eos} == expected, f"step {step}"
        assert bool(torch.isfinite(logits[0]).all()), "a row without a grammar is untouched"
        assert (eos in masked) == reference.is_accepting(), f"step {step}: EOS exactly when the grammar accepts"
        assert t in masked
        assert reference.consume_token(t)
        structured.accept("r", t)
    assert reference.is_stopped()


def test_apply_bitmask_pads_ids_past_the_mask():
    logits = torch.zeros(3, 40)
    bitmask = torch.tensor([[0b101]], dtype=torch.int32)  # one word: ids 0 and 2 allowed; 32..39 not covered
    apply_bitmask(logits, bitmask, [1])
    assert torch.isfinite(logits[0]).all() and torch.isfinite(logits[2]).all()
    assert [i for i in range(40) if torch.isfinite(logits[1, i])] == [0, 2]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_hand_off_and_migration_continue_identically(model_dir, engine, tok, temperature):
    """The prefill engine samples the first token under the grammar and hands its KV on; the decode engine's
    matcher replays it. A request migrated with k tokens so far recomputes and replays them. Both write
    exactly what one engine wrote (seeded sampling is keyed by position)."""
    spec = specs.json_schema(SCHEMAS["nested"])
    _, whole = _run(engine, tok, spec, temperature, seed=11)
    prompt = _prompt(tok)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=temperature, seed=11, structured=spec)
    prefill = Engine.from_dir(model_dir, max_model_len=1024)
    first = SamplingParams(max_tokens=1, temperature=temperature, seed=11, structured=spec)
    prefill.add_request("p", prompt, first, hold_kv=True)
    (out,) = prefill.step()
    decode = Engine.from_dir(model_dir, max_model_len=1024)
    decode.import_kv("p", prompt, out.new_token_ids, params, prefill.export_kv("p"))
    handed = list(out.new_token_ids)
    while decode.has_unfinished():
        for o in decode.step():
            handed += o.new_token_ids
    assert handed == whole
    k = len(whole) // 2
    migrated = Engine.from_dir(model_dir, max_model_len=1024)
    migrated.add_request("m", prompt, params, output_token_ids=whole[:k])
    rest: list[int] = []
    while migrated.has_unfinished():
        for o in migrated.step():
            rest += o.new_token_ids
    assert whole[:k] + rest == whole


def test_invalid_specs_are_refused_by_name(engine, tok):
    grammars = Grammars(tok.to_json(), tok.vocab_size, tok.eos_token_ids)
    for bad, words in [
        (specs.regex("(("), "unclosed group"),
        (specs.json_schema({"type": "nope"}), "nope"),
        (specs.lark("start: ("), "Expected"),
    ]:
        with pytest.raises(GrammarError, match=words):
            grammars.check(bad)
        with pytest.raises(ValueError):
            engine.add_request("bad", _prompt(tok), SamplingParams(structured=bad))
    assert "bad" not in engine.requests and "bad" not in engine.structured


def test_replayed_output_must_follow_the_grammar(engine, tok):
    with pytest.raises(ValueError, match="does not follow"):
        engine.add_request(
            "off", _prompt(tok), SamplingParams(structured=specs.regex("[0-9]+")), output_token_ids=tok.encode("ab")
        )
    assert llguidance.LLMatcher  # the engine named in docs/api.md is the one in use


def test_each_of_n_choices_follows_the_grammar_and_equals_its_single_request(model_dir, engine, tok):
    """n > 1 under a constraint: the choices forked at the first token get matchers of their own (replaying that
    token), so each follows the grammar and equals the single request with its derived seed."""
    from shared.engine.fork import Choice, choice_params

    schema = SCHEMAS[sorted(SCHEMAS)[0]]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=11, structured=specs.json_schema(schema))
    prompt = _prompt(tok)
    group = Engine.from_dir(model_dir, max_model_len=1024)
    group.add_group(prompt, [Choice(f"c{i}", choice_params(params, i)) for i in range(3)])
    got: dict[str, list[int]] = {}
    while group.has_unfinished():
        for o in group.step():
            got.setdefault(o.request_id, []).extend(o.new_token_ids)
    group.check_integrity()
    for i in range(3):
        jsonschema.validate(json.loads(tok.decode(got[f"c{i}"])), schema)
        assert got[f"c{i}"] == engine.generate([prompt], choice_params(params, i))[0], f"choice {i}"
