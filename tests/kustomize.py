"""The part of kustomize that deploy/k8s/ uses, so that the tests render its overlays without a kustomize binary:
resources (files and directories), components, JSON 6902 patches with a kind/name target (the name a regular
expression, as kustomize matches it) and a secretGenerator of files without a name suffix. Anything else in a
kustomization is refused, so that a manifest using more fails here until this learns it; where kubectl is
installed, tests/integration/test_k8s.py holds this rendering to `kubectl kustomize`'s."""

from __future__ import annotations

import base64
import copy
import re
from pathlib import Path
from typing import Any

import yaml

Object = dict[str, Any]
KNOWN = {"apiVersion", "kind", "resources", "components", "patches", "secretGenerator", "generatorOptions"}


def load(directory: Path) -> Object:
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(kustomization) - KNOWN
    if unknown:
        raise NotImplementedError(f"{directory}: tests/kustomize.py does not render {sorted(unknown)}")
    return kustomization


def render(directory: Path) -> list[Object]:
    """The objects `kubectl kustomize directory` prints (in file order, not kustomize's)."""
    kustomization = load(directory)
    objects = _resources(directory, kustomization)
    for component in kustomization.get("components", []):
        objects = _component(directory / component, objects)
    return _patched(objects, kustomization.get("patches", []))


def _resources(directory: Path, kustomization: Object) -> list[Object]:
    objects: list[Object] = []
    for entry in kustomization.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else [d for d in yaml.safe_load_all(path.read_text()) if d]
    options = kustomization.get("generatorOptions", {})
    for generator in kustomization.get("secretGenerator", []):
        if options != {"disableNameSuffixHash": True}:
            raise NotImplementedError("a secretGenerator with name suffixes (their hash is kustomize's)")
        objects.append(_secret(directory, generator))
    return objects


def _component(directory: Path, objects: list[Object]) -> list[Object]:
    component = load(directory)
    assert component["kind"] == "Component", directory
    return _patched(objects + _resources(directory, component), component.get("patches", []))


def _secret(directory: Path, generator: Object) -> Object:
    data = {}
    for entry in generator["files"]:
        key, _, path = entry.rpartition("=") if "=" in entry else (Path(entry).name, "", entry)
        data[key] = base64.b64encode((directory / path).read_bytes()).decode()
    return {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": generator["name"]}, "type": "Opaque",
            "data": data}  # fmt: skip


def _patched(objects: list[Object], patches: list[Object]) -> list[Object]:
    for patch in patches:
        target = patch["target"]
        operations = yaml.safe_load(patch["patch"])
        assert isinstance(operations, list), "only JSON 6902 patches (a list of operations)"
        matched = [o for o in objects if _matches(o, target)]
        assert matched, f"the patch's target {target} matches nothing"
        for obj in matched:
            for op in operations:
                apply_operation(obj, op)
    return objects


def _matches(obj: Object, target: Object) -> bool:
    unknown = set(target) - {"kind", "name"}
    if unknown:
        raise NotImplementedError(f"patch targets by {sorted(unknown)}")
    name = target.get("name")
    return obj["kind"] == target.get("kind", obj["kind"]) and (
        name is None or re.fullmatch(name, obj["metadata"]["name"]) is not None
    )


def apply_operation(obj: Object, op: Object) -> None:
    """One JSON patch operation (RFC 6902: add, replace, remove) on `obj`, in place."""
    *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    value = copy.deepcopy(op.get("value"))
    kind = op["op"]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if kind == "add":
            node.insert(index, value)
        elif kind == "replace":
            node[index] = value
        elif kind == "remove":
            del node[index]
        else:
            raise NotImplementedError(kind)
        return
    if kind in ("replace", "remove") and last not in node:
        raise KeyError(f"{op['path']}: nothing to {kind}")
    if kind == "remove":
        del node[last]
    elif kind in ("add", "replace"):
        node[last] = value
    else:
        raise NotImplementedError(kind)
