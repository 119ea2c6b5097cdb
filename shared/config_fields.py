"""A setting is declared once: a field of a frozen dataclass, with its docstring under it. From that
declaration come its environment name, its command-line flag and its help text, and this module builds the
settings from the environment and the command line.

Shape: a field whose type is a dataclass is a *section* (its fields are settings too, nested); every other
field is a *knob*. A knob's flat name is the prefixes of the sections it sits in plus its own name, unless
it gives one of its own (`flat(...)`, to keep a name that predates the section):

    kv: KvTransferSettings = section(KvTransferSettings, prefix="kv_")   # in WorkerSettings
    lease_s: float = 30.0                                                 # in KvTransferSettings,
    # with the docstring "Prefill workers free a request's KV ..." under it

gives `settings.kv.lease_s`, PDSERVE_KV_LEASE_S (or a file named by PDSERVE_KV_LEASE_S_FILE), `--kv-lease-s`,
and that docstring as its help. Knob types: str, int, float, bool, an enum, tuple[str, ...] (comma-separated),
each possibly `| None` (then an empty value means None). Secrets (`repr=False`) stay out of reprs and get no
flag unless they ask for one (`metadata={"flag": True}`): a command line is visible to every user of the host.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import os
import textwrap
import types
import typing
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, TypeGuard

ENV_PREFIX = "PDSERVE_"


def section(factory: Any, prefix: str = "") -> Any:
    """A nested section, built by `factory()` unless set; `prefix` goes before its knobs' names."""
    return field(default_factory=factory, metadata={"prefix": prefix})


def flat(name: str, default: Any) -> Any:
    """A knob whose flat name is `name`, whatever section it sits in."""
    return field(default=default, metadata={"name": name})


@dataclass(frozen=True)
class Knob:
    """One setting, as the environment and the command line see it."""

    path: tuple[str, ...]  # attributes from the root settings: ("engine", "scheduler", "max_num_seqs")
    name: str  # flat name: max_num_seqs
    kind: Any  # the value's type, `| None` removed
    optional: bool
    default: Any
    doc: str
    secret: bool
    flag: bool  # has a command-line flag

    @property
    def env(self) -> str:
        return ENV_PREFIX + self.name.upper()

    @property
    def flags(self) -> list[str]:
        # `enable_x` also answers to --x / --no-x (e.g. --no-chunked-prefill)
        names = [self.name] + ([self.name.removeprefix("enable_")] if self.name.startswith("enable_") else [])
        return ["--" + n.replace("_", "-") for n in names]

    def parse(self, raw: str, source: str) -> Any:
        """`raw` (from `source`: an environment variable or a flag) as this knob's type; ValueError if not."""
        if raw == "" and self.optional:
            return None
        try:
            if self.kind is bool:
                if raw.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError(raw)
                return raw.lower() in ("1", "true", "yes")
            if typing.get_origin(self.kind) is tuple:
                return tuple(x.strip() for x in raw.split(",") if x.strip())
            return self.kind(raw)
        except ValueError:
            raise ValueError(f"{source}={raw!r} is not a valid {self.type_name}") from None

    @property
    def type_name(self) -> str:
        if isinstance(self.kind, type) and issubclass(self.kind, Enum):
            return " | ".join(str(m.value) for m in self.kind)
        if typing.get_origin(self.kind) is tuple:
            return "comma-separated list"
        return getattr(self.kind, "__name__", str(self.kind))

    def help(self) -> str:
        where = f"env {self.env}" + (f" or {self.env}_FILE" if self.secret else "")
        default = "" if self.default in (None, (), dataclasses.MISSING) or self.secret else f"; default {self.default}"
        return f"{self.doc} ({where}{default})".replace("%", "%%").strip()


@functools.cache
def knobs(cls: type) -> tuple[Knob, ...]:
    """Every knob of the settings class `cls`, sections flattened; ValueError if two share a name."""
    found = tuple(_knobs(cls, "", (), None))
    names = [k.name for k in found]
    if dupes := {n for n in names if names.count(n) > 1}:
        raise ValueError(f"{cls.__name__}: more than one setting is named {sorted(dupes)}")
    return found


def _knobs(cls: type, prefix: str, path: tuple[str, ...], base: Any) -> list[Knob]:
    hints = typing.get_type_hints(cls)
    out: list[Knob] = []
    for f in dataclasses.fields(cls):
        kind, optional = _unwrap_optional(hints[f.name])
        if _is_section(kind):
            sub_base = getattr(base, f.name) if base is not None else _field_default(f)
            out += _knobs(kind, prefix + f.metadata.get("prefix", ""), (*path, f.name), sub_base)
            continue
        # a default made per instance (an id) has none to show
        default = getattr(base, f.name) if base is not None else f.default
        name = f.metadata.get("name", prefix + f.name)
        secret = not f.repr
        flag = f.metadata.get("flag", not secret)
        out.append(Knob((*path, f.name), name, kind, optional, default, _doc(cls, f.name), secret, flag))
    return out


def _unwrap_optional(hint: Any) -> tuple[Any, bool]:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0], len(args) < len(typing.get_args(hint))
    return hint, False


def _is_section(kind: Any) -> TypeGuard[type]:
    """Whether a field's (unwrapped) hint is a nested settings section: a dataclass, the class, not an instance."""
    return isinstance(kind, type) and dataclasses.is_dataclass(kind)


def _field_default(f: dataclasses.Field) -> Any:
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return f.default


def _doc(cls: type, name: str) -> str:
    for klass in cls.__mro__:
        if dataclasses.is_dataclass(klass) and name in (docs := _docstrings(klass)):
            return docs[name]
    return ""


@functools.cache
def _docstrings(cls: type) -> dict[str, str]:
    """Field name → the string literal right under the field in the class body (attribute docstrings)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):  # no source (e.g. a class built at run time)
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, after in zip(body, body[1:], strict=False):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            docs[node.target.id] = " ".join(inspect.cleandoc(after.value.value).split())
    return docs


# ---- building settings --------------------------------------------------------------------------------


def from_env(cls: type, environ: typing.Mapping[str, str] | None = None, **overrides: Any) -> Any:
    """Build `cls` from PDSERVE_* variables (or the files PDSERVE_*_FILE name), then `overrides` by flat
    name (None values are ignored; strings are parsed as the environment's are). ValueError for a value that
    does not parse or does not validate, TypeError for an override that is no setting."""
    environ = os.environ if environ is None else environ
    all_knobs = knobs(cls)
    values: dict[tuple[str, ...], Any] = {}
    for k in all_knobs:
        raw = environ.get(k.env)
        path = environ.get(k.env + "_FILE")
        if raw is None and path:
            raw = _read_secret_file(k.env + "_FILE", path)
        if raw is not None:
            values[k.path] = k.parse(raw, k.env)
    by_name = {k.name: k for k in all_knobs}
    for name, value in overrides.items():
        if name not in by_name:
            raise TypeError(f"{cls.__name__} has no setting {name!r}")
        k = by_name[name]
        if value is not None:
            values[k.path] = k.parse(value, k.flags[0]) if isinstance(value, str) and k.kind is not str else value
    return _build(cls, values, (), None)


def _build(cls: type, values: dict[tuple[str, ...], Any], path: tuple[str, ...], base: Any) -> Any:
    """`cls` with the values under `path` set: on `base` (a section's default instance) or from scratch."""
    hints = typing.get_type_hints(cls)
    kwargs = {}
    for f in dataclasses.fields(cls):
        here = (*path, f.name)
        kind, _ = _unwrap_optional(hints[f.name])
        if _is_section(kind):
            if any(p[: len(here)] == here for p in values):
                sub_base = getattr(base, f.name) if base is not None else _field_default(f)
                kwargs[f.name] = _build(kind, values, here, sub_base)
        elif here in values:
            kwargs[f.name] = values[here]
    return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)


def _read_secret_file(variable: str, path: str) -> str:
    try:
        with open(path, encoding="utf-8") as f:
            return f.read().strip()
    except OSError as exc:
        raise ValueError(f"{variable}={path!r} cannot be read: {exc.strerror}") from exc


# ---- the command line ---------------------------------------------------------------------------------


def add_flags(parser: argparse.ArgumentParser, cls: type, skip: tuple[str, ...] = ()) -> None:
    """A flag for every knob of `cls` that has one (not those named in `skip`), its help the docstring.
    Flags default to None: an unset flag leaves the environment's value."""
    for k in knobs(cls):
        if not k.flag or k.name in skip:
            continue
        if k.kind is bool:
            parser.add_argument(*k.flags, dest=k.name, action=argparse.BooleanOptionalAction, help=k.help())
        elif isinstance(k.kind, type) and issubclass(k.kind, Enum):
            choices = [str(m.value) for m in k.kind]
            parser.add_argument(*k.flags, dest=k.name, choices=choices, help=k.help())
        else:
            metavar = "A,B" if typing.get_origin(k.kind) is tuple else k.type_name.upper()
            parser.add_argument(*k.flags, dest=k.name, metavar=metavar, help=k.help())


def from_args(cls: type, args: argparse.Namespace, environ: typing.Mapping[str, str] | None = None) -> Any:
    """Build `cls` from the environment, with the flags `add_flags` made (and any knob set as a parser
    default, e.g. the role a subcommand fixes) overriding it."""
    return from_env(cls, environ, **{k.name: getattr(args, k.name, None) for k in knobs(cls)})
