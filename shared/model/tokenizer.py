"""Tokenizer and chat template of a Hugging Face checkpoint directory.

`tokenizer.json` through the `tokenizers` library; the chat template (from `tokenizer_config.json` or
`chat_template.jinja`) rendered with a sandboxed jinja2 environment configured as transformers does, so
templates written for HF render the same here.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer


class ChatTemplateError(ValueError):
    """The checkpoint has no chat template, or rendering it failed for these messages."""


def _raise(message: str) -> None:
    raise ChatTemplateError(message)


def _special(value: Any) -> str | None:
    # tokenizer_config.json writes special tokens as strings or as {"content": ...} objects.
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    def __init__(self, model_dir: str | Path) -> None:
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json")
        self._tok = HFTokenizer.from_file(str(path))
        cfg = _read_json(model_dir / "tokenizer_config.json")
        template_file = model_dir / "chat_template.jinja"
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        self.chat_template: str | None = template or (template_file.read_text() if template_file.is_file() else None)
        self.bos_token = _special(cfg.get("bos_token"))
        self.eos_token = _special(cfg.get("eos_token"))
        self.eos_token_ids = self._eos_ids(model_dir)
        self._template: jinja2.Template | None = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def _eos_ids(self, model_dir: Path) -> tuple[int, ...]:
        ids: list[int] = []
        for source in (_read_json(model_dir / "generation_config.json"), _read_json(model_dir / "config.json")):
            eos = source.get("eos_token_id")
            ids.extend(eos if isinstance(eos, list) else [] if eos is None else [eos])
        if self.eos_token is not None and (tid := self._tok.token_to_id(self.eos_token)) is not None:
            ids.append(tid)
        return tuple(dict.fromkeys(ids))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def to_json(self) -> str:
        """tokenizer.json's content (what a grammar engine builds its token tables from)."""
        return self._tok.to_str()

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if self.chat_template is None:
            raise ChatTemplateError("this model has no chat template; use the completions API")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(
                trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
            )
            env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                tools=tools,  # as transformers passes them (None without tools)
                bos_token=self.bos_token or "",
                eos_token=self.eos_token or "",
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from exc

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template already writes any BOS it wants: do not let the post-processor add another.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}
