"""The token strings vLLM reports for an answer's ids (the agent soak's check compares the
server's log-prob tokens with these, not with each id decoded alone)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def _space_marker(tokenizer: Any) -> str | None:
    """The Metaspace replacement character whose leading instances ``decode`` strips (a
    SentencePiece tokenizer's ``▁``), as vLLM reads it; None for byte-level tokenizers."""
    import json

    backend = getattr(tokenizer, "backend_tokenizer", None)
    try:
        pre = (json.loads(backend.to_str()).get("pre_tokenizer") or {}) if backend else {}
    except (ValueError, AttributeError):
        return None
    subs = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    for sub in subs:
        if (sub or {}).get("type") == "Metaspace":
            return str(sub.get("replacement", "\u2581"))
    return None


def _single(tokenizer: Any, token: int, marker: str | None) -> str:
    text = tokenizer.decode([token]) or ""
    if marker is None:
        return str(text)
    raw = str((tokenizer.convert_ids_to_tokens([token]) or [""])[0] or "")
    lead = len(raw) - len(raw.lstrip(marker))
    missing = lead - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else str(text)


def served_strings(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    """The token strings vLLM reports in the log-probs of an answer of ``ids``: each token
    decoded alone (a SentencePiece token's leading spaces restored); a token whose text ends in
    an unfinished UTF-8 sequence (U+FFFD, a byte-fallback token) is decoded with up to 4
    preceding answer tokens as context: ``""`` while the character is unfinished, the whole
    character on the token that completes it. Comparing these with the server's strings, not
    each id decoded alone, is what makes a multi-byte answer (Korean, Hindi) comparable.

    Example:
        >>> class Bytes:  # ids are UTF-8 bytes
        ...     def decode(self, ids): return bytes(ids).decode(errors="replace")
        >>> served_strings(Bytes(), list("스a".encode()))
        ['', '', '스', 'a']
    """
    marker = _space_marker(tokenizer)
    out: list[str] = []
    for i, token in enumerate(int(t) for t in ids):
        text = _single(tokenizer, token, marker)
        if text.endswith("\ufffd"):
            text = _completed(tokenizer, [int(t) for t in ids[max(0, i - 4):i]], token)
        out.append(text)
    return out


def _completed(tokenizer: Any, context: list[int], token: int) -> str:
    """vLLM's correction of a byte-fallback token's string from the answer's preceding tokens."""
    for n in range(1, len(context) + 1):
        ctx = context[-n:]
        full = str(tokenizer.decode(ctx + [token]))
        if full.endswith("\ufffd"):
            continue
        clean = len(ctx)
        for j in range(len(ctx) - 1, -1, -1):
            if str(tokenizer.decode([ctx[j]])).endswith("\ufffd"):
                clean = j
            else:
                break
        prefix = str(tokenizer.decode(ctx[:clean])) if clean else ""
        if full.startswith(prefix):
            return full[len(prefix):]
        common = 0
        for a, b in zip(prefix, full, strict=False):
            if a != b:
                break
            common += 1
        return full[common:]
    return ""
