"""`tools` and `tool_choice` → what the chat template gets, whether the output is read for calls, and the output
constraint (required / a named function: one call of those tools, enforced by structured output).

    none      tools not rendered, output not parsed (plain text)
    auto      tools rendered, output parsed; the model decides (no constraint)
    required  tools rendered, output constrained to a call of one of them
    {"type": "function", "function": {"name": N}}  rendered, constrained to a call of N
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from services.gateway.errors import APIError
from services.gateway.schemas import ChatCompletionRequest
from services.gateway.tools.parsers import ToolParser
from shared.structured.spec import StructuredSpec


@dataclass(frozen=True)
class ToolPlan:
    template_tools: list[dict[str, Any]]  # the `tools` the chat template receives (OpenAI's shape)
    parser: ToolParser  # reads the output back into tool_calls
    constraint: StructuredSpec | None  # required / named: the output must be a call


def plan_tools(req: ChatCompletionRequest, parser: ToolParser) -> ToolPlan | None:
    """None when the request has no tools or tool_choice is none. Raises APIError for a bad tool_choice."""
    choice = req.tool_choice if req.tool_choice is not None else "auto"
    if not req.tools:
        if choice not in ("none", "auto"):
            raise APIError(400, "tool_choice needs `tools`", "tool_choice")
        return None
    names = [t.function.name for t in req.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tool function names must be unique", "tools")
    for i, t in enumerate(req.tools):
        if t.type != "function":
            raise APIError(400, f"only function tools are supported, got {t.type!r}", f"tools[{i}].type")
    if choice == "none":
        return None
    rendered = [
        {"type": "function", "function": {k: v for k, v in _function(t).items() if v is not None}} for t in req.tools
    ]
    if choice == "auto":
        return ToolPlan(rendered, parser, None)
    if choice == "required":
        chosen = [_function(t) for t in req.tools]
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        chosen = [_function(t) for t in req.tools if t.function.name == name]
        if not chosen:
            raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", "tool_choice")
    else:
        raise APIError(
            400,
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name"}}',
            "tool_choice",
        )
    return ToolPlan(rendered, parser, parser.constraint(chosen))


def _function(tool: Any) -> dict[str, Any]:
    f = tool.function
    return {"name": f.name, "description": f.description, "parameters": f.parameters}
