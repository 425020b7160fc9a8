"""Tool calls in one fixed JSON format, parsed and validated; malformed calls are reported.

Format (see skills/tools.txt): ``{"tool": NAME, "args": {ARG: VALUE, ...}}`` on one line.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvnotes.core.jsontext import first_object
from kvnotes.core.records import Json

# tool name -> {argument: type}; every argument is required, no others are allowed
TOOLS: dict[str, dict[str, type]] = {
    "cancel_reservation": {"reservation_id": str, "reason": str},
    "issue_refund": {"reservation_id": str, "amount": int, "payment_method": str},
    "issue_voucher": {"reservation_id": str, "amount": int},
    "update_baggage": {"reservation_id": str, "checked_bags": int},
    "update_account": {"field": str, "value": str},
    "upgrade_cabin": {"reservation_id": str, "cabin": str},
    "transfer_to_human": {"summary": str},
}

# the text the agent writes before the model continues a tool call
TOOL_CALL_PREFIX = '\nTool call: {"tool": "'


@dataclass(frozen=True, slots=True)
class ToolCall:
    """A parsed tool call: ``ok`` with ``tool``/``args``, or not ``ok`` with the ``error``."""

    raw: str
    ok: bool
    tool: str | None = None
    args: Json = field(default_factory=dict)
    error: str | None = None

    def to_dict(self) -> Json:
        return {"raw": self.raw, "ok": self.ok, "tool": self.tool, "args": self.args,
                "error": self.error}


def parse_tool_call(text: str, *, expected: str | None = None) -> ToolCall:
    """Parse and validate a tool call; never raises on model output.

    ``expected``: when given, a call of another tool is reported as an error.
    """
    body = first_object(text)
    if body is None:
        return ToolCall(text, False, error="no complete JSON object in the output")
    try:
        data = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall(text, False, error=f"invalid JSON: {err.msg}")
    if not isinstance(data, dict) or set(data) != {"tool", "args"}:
        keys = sorted(data) if isinstance(data, dict) else type(data).__name__
        return ToolCall(text, False, error=f"expected keys ['args', 'tool'], got {keys}")
    tool, args = data["tool"], data["args"]
    if tool not in TOOLS:
        return ToolCall(text, False, tool=str(tool),
                        error=f"unknown tool {tool!r}; tools: {sorted(TOOLS)}")
    if not isinstance(args, dict):
        return ToolCall(text, False, tool=tool, error="'args' must be a JSON object")
    schema = TOOLS[tool]
    missing, extra = sorted(set(schema) - set(args)), sorted(set(args) - set(schema))
    if missing or extra:
        return ToolCall(text, False, tool=tool, args=args,
                        error=f"{tool}: missing arguments {missing}, unexpected {extra}")
    for name, kind in schema.items():
        value = args[name]
        if not isinstance(value, kind) or isinstance(value, bool):
            return ToolCall(text, False, tool=tool, args=args,
                            error=f"{tool}: argument {name!r} must be {kind.__name__}")
    if expected is not None and tool != expected:
        return ToolCall(text, False, tool=tool, args=args,
                        error=f"called {tool!r} where the request needs {expected!r}")
    return ToolCall(text, True, tool=tool, args=args)
