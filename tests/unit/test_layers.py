"""The layering rules are enforced: import-linter's contracts (pyproject.toml, `make lint`) break on a forbidden
import, and the gateway imports without loading torch."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# One forbidden import per rule, added to a copy of the tree: (file, the line added, the contract that must
# break, the import it must name).
FORBIDDEN = [
    ("shared/model/layers.py", "import shared.engine.engine", "The model knows no requests",
     "shared.model.layers -> shared.engine.engine"),
    ("shared/engine/scheduler.py", "import shared.messages", "The engine speaks no wire",
     "shared.engine.scheduler -> shared.messages"),
    ("shared/engine/runner.py", "import shared.parallel.ops", "The engine knows nothing of the worker group",
     "shared.engine.runner -> shared.parallel.ops"),
    ("services/gateway/sse.py", "import torch", "The gateway loads no torch", "services.gateway.sse -> torch"),
    ("services/decode/worker.py", "import services.gateway.app", "Workers never import the gateway",
     "services.decode.worker -> services.gateway.app"),
    ("shared/settings.py", "import services.local.stack", "Library code never imports tooling",
     "shared.settings -> services.local.stack"),
    ("shared/model/linear.py", "import shared.model.transformer", "No import cycles",
     ".linear -> .transformer"),
]  # fmt: skip


def _lint_imports(tree: Path) -> subprocess.CompletedProcess:
    code = "import sys; from importlinter.cli import lint_imports; sys.exit(lint_imports(no_cache=True, no_logo=True))"
    env = {**os.environ, "PYTHONPATH": str(tree), "COLUMNS": "400"}  # a contract's name on one line
    return subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True, timeout=120)


def test_each_rule_breaks_on_a_forbidden_import(tmp_path):
    """One run over a copy of the tree with every forbidden import above added: each names its contract as broken
    and the import that breaks it."""
    shutil.copy(ROOT / "pyproject.toml", tmp_path)
    for package in ("shared", "services"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    for path, line, _, _ in FORBIDDEN:
        with open(tmp_path / path, "a") as f:
            f.write(f"\n{line}  # noqa\n")
    result = _lint_imports(tmp_path)
    report = result.stdout
    assert result.returncode == 1, report + result.stderr
    broken = report[report.index("Broken contracts") :]
    for _, _, contract, chain in FORBIDDEN:
        assert re.search(rf"^{re.escape(contract)}.* BROKEN", report, re.M), contract
        assert chain in broken, (contract, chain)


def test_the_gateway_imports_without_torch():
    """In a fresh interpreter: the app and the process's entry point load neither torch nor triton."""
    code = (
        "import sys, services.gateway.app, services.gateway.main; print(sorted({'torch', 'triton'} & set(sys.modules)))"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "[]"
