"""The tool-call parser of a model: one per template family, chosen by settings.tool_call_parser or, for "auto",
from the chat template. This module imports the parsers; they import only their interface (parsers.py)."""

from __future__ import annotations

from services.gateway.tools.hermes import HermesParser
from services.gateway.tools.llama3_json import Llama3JsonParser
from services.gateway.tools.parsers import ToolParser


def parser_for(setting: str, chat_template: str | None) -> ToolParser:
    """settings.tool_call_parser, or for "auto" the family the chat template writes (Hermes when unsure)."""
    if setting == "llama3_json":
        return Llama3JsonParser()
    if setting == "hermes":
        return HermesParser()
    template = chat_template or ""
    if "<tool_call>" not in template and ("<|python_tag|>" in template or "ipython" in template):
        return Llama3JsonParser()
    return HermesParser()
