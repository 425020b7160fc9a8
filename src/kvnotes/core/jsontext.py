"""Finding JSON in model output: the first balanced ``{...}``, read string-aware (a brace inside
a quoted string does not count), so a call followed by more text can still be parsed."""

from __future__ import annotations


def first_object(text: str) -> str | None:
    """The first balanced ``{...}`` in ``text``, or None when none closes."""
    start = text.find("{")
    if start < 0:
        return None
    depth, in_str, escaped = 0, False, False
    for i in range(start, len(text)):
        c = text[i]
        if in_str:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i + 1]
    return None
