"""Extract from OpenAI's published OpenAPI document the component schemas pdserve's responses are validated
against (tests/openai_schema.py), and the request schemas whose fields docs/api.md and
services/gateway/unsupported.py account for, into schemas.json beside this script.

    python tests/data/openai_openapi/extract.py [OPENAPI_JSON]

OPENAPI_JSON defaults to openapi.json at the pinned commit of a local copy of github.com/openai/openai-openapi
(`git show <COMMIT>:openapi.json`, from the directory in $OPENAI_OPENAPI_REPO). The result is one JSON Schema
2020-12 document: each component under `$defs` (references rewritten to `#/$defs/<name>`), `nullable: true`
(OpenAPI 3.0's spelling, which the 3.1 document still uses in places) rewritten as `anyOf [..., null]`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

COMMIT = "f85dbe2"
DEFAULT_REPO = "/work/.mirror/openai+openai-openapi/repo"
ROOTS = (
    "CreateChatCompletionResponse",
    "CreateChatCompletionStreamResponse",
    "CreateCompletionResponse",
    "ListModelsResponse",
    "Model",
    "CreateChatCompletionRequest",
    "CreateCompletionRequest",
    "ErrorResponse",
)
PREFIX = "#/components/schemas/"


def _load(argv: list[str]) -> dict[str, Any]:
    if argv:
        return json.loads(Path(argv[0]).read_text())
    repo = os.environ.get("OPENAI_OPENAPI_REPO", DEFAULT_REPO)
    text = subprocess.run(
        ["git", "-C", repo, "show", f"{COMMIT}:openapi.json"], check=True, capture_output=True, text=True
    ).stdout
    return json.loads(text)


def _refs(node: Any, found: set[str]) -> None:
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(PREFIX):
            found.add(ref.removeprefix(PREFIX))
        for value in node.values():
            _refs(value, found)
    elif isinstance(node, list):
        for value in node:
            _refs(value, found)


def _rewrite(node: Any) -> Any:
    """References into $defs; `nullable: true` as an anyOf with null."""
    if isinstance(node, list):
        return [_rewrite(v) for v in node]
    if not isinstance(node, dict):
        return node
    out = {k: _rewrite(v) for k, v in node.items() if k != "nullable"}
    if isinstance(out.get("$ref"), str):
        out["$ref"] = "#/$defs/" + out["$ref"].removeprefix(PREFIX)
    if node.get("nullable") is True:
        return {"anyOf": [out, {"type": "null"}]}
    return out


def extract(document: dict[str, Any]) -> dict[str, Any]:
    schemas = document["components"]["schemas"]
    todo, seen = list(ROOTS), set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            found: set[str] = set()
            _refs(schemas[name], found)
            todo.extend(found)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": f"extracted from github.com/openai/openai-openapi openapi.json at {COMMIT} (MIT) by extract.py",
        "$defs": {name: _rewrite(schemas[name]) for name in sorted(seen)},
    }


if __name__ == "__main__":
    out = Path(__file__).with_name("schemas.json")
    out.write_text(json.dumps(extract(_load(sys.argv[1:])), indent=1, sort_keys=True) + "\n")
    print(f"wrote {out}")
