"""The `pdserve` command line: demo checkpoints and one-process generation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from services.cli import main
from shared.engine.engine import Engine
from shared.engine.sampling import SamplingParams
from shared.model.config import ARCHITECTURES, ArchSpec, ModelConfig
from shared.model.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def demo_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo")
    assert main(["demo-model", str(out), "--arch", "mixtral", "--size", "tiny", "--seed", "3"]) == 0
    return out


def test_demo_model_is_deterministic(tmp_path, demo_dir):
    again = tmp_path / "again"
    assert main(["demo-model", str(again), "--arch", "mixtral", "--seed", "3"]) == 0
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (again / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_generate_json(demo_dir, capsys):
    rc = main(["generate", "--model", str(demo_dir), "--max-tokens", "12", "--ignore-eos", "--json", "héllo 世界"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    tok = Tokenizer(demo_dir)
    assert out["prompt_token_ids"] == tok.encode("héllo 世界")
    assert len(out["token_ids"]) == 12
    assert out["text"] == tok.decode(out["token_ids"])
    assert out["finish_reason"] == "length"


def test_generate_chat_greedy_is_reproducible(demo_dir, capsys):
    args = ["generate", "--model", str(demo_dir), "--chat", "--max-tokens", "8", "--json", "hi"]
    main(args)
    first = json.loads(capsys.readouterr().out)
    main(args)
    assert json.loads(capsys.readouterr().out)["token_ids"] == first["token_ids"]
    assert first["prompt_token_ids"] == Tokenizer(demo_dir).encode_chat([{"role": "user", "content": "hi"}])


def test_generate_n_choices_equal_single_runs_with_the_derived_seeds(demo_dir, capsys):
    common = ["generate", "--model", str(demo_dir), "--max-tokens", "8", "--ignore-eos", "--temperature", "1", "--json"]
    assert main([*common, "--n", "3", "--seed", "5", "hello"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [c["index"] for c in out["choices"]] == [0, 1, 2]
    assert out["prefill_tokens"] == len(out["prompt_token_ids"])  # the prompt computed once
    singles = []
    for seed in (5, 6, 7):
        main([*common, "--seed", str(seed), "hello"])
        singles.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert [c["token_ids"] for c in out["choices"]] == singles
    assert len({tuple(t) for t in singles}) > 1
    assert main([*common, "--n", "0", "hello"]) == 2


def test_generate_reports_bad_input(demo_dir, tmp_path, capsys):
    assert main(["generate", "--model", str(tmp_path), "x"]) == 2
    assert "tokenizer.json" in capsys.readouterr().err
    assert main(["generate", "--model", str(demo_dir), "--max-tokens", "0", "x"]) == 2
    assert "max_tokens" in capsys.readouterr().err


@pytest.mark.slow  # two fresh interpreters importing torch under -OO, ~20-50 s on 2 cores: the slow tier
def test_parser_builds_without_docstrings():
    """`python -OO` (or PYTHONOPTIMIZE=2) strips docstrings; the bench and trace commands take their
    descriptions from their module's, and building the parser used to fail on None.split."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    for command in ("bench", "trace"):
        done = subprocess.run(
            [sys.executable, "-OO", "-m", "services.cli", command, "--help"], env=env, capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr
        assert f"pdserve {command}" in done.stdout


def test_generate_penalty_flags_change_the_tokens_as_the_engine_does(demo_dir, capsys):
    base = ["generate", "--model", str(demo_dir), "--max-tokens", "24", "--ignore-eos", "--json", "hi"]
    outs = []
    for extra in ([], ["--presence-penalty", "2", "--repetition-penalty", "1.5"]):
        assert main(base + extra) == 0
        outs.append(json.loads(capsys.readouterr().out)["token_ids"])
    assert outs[0] != outs[1]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, presence_penalty=2, repetition_penalty=1.5)
    assert Engine.from_dir(demo_dir).generate([Tokenizer(demo_dir).encode("hi")], params)[0] == outs[1]


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_demo_model_writes_every_architecture(tmp_path, arch):
    assert main(["demo-model", str(tmp_path), "--arch", arch]) == 0
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == arch
    assert ModelConfig.from_dir(tmp_path).model_type == arch


def test_demo_model_choices_are_the_architectures(tmp_path, monkeypatch, capsys):
    """--arch offers what ARCHITECTURES holds, not a list of its own: a new entry is a valid choice at once
    (and without a demo definition it is refused by the demo writer, not by the argument parser)."""
    monkeypatch.setitem(ARCHITECTURES, "new_arch", ArchSpec())
    assert main(["demo-model", str(tmp_path), "--arch", "new_arch"]) == 2
    assert "no demo checkpoint is defined for 'new_arch'" in capsys.readouterr().err
