"""BFCL's own AST checker on a call the model wrote after the opening ``{"name": "``.

The answer is read as JSON: the opening plus the generated text, up to the end of the first
complete object (``{"name": ..., "arguments": {...}}``); a text that never closes it, or is not
JSON of that shape, is *unparsable* (small models often are: the checker is run where a call
parses). A parsed call goes to ``bfcl_eval.eval_checker.ast_eval.ast_checker.ast_checker``
with the case's function descriptions and BFCL's possible answers, as BFCL's own evaluation
runs it for the ``live_multiple`` category (Python types).

The checker module imports BFCL's model registry, which imports every API vendor's client
library; ``bfcl-eval`` is installed without its dependencies, so when that import fails the
registry is replaced, for the checker's import only, by one entry that keeps function names as
written (BFCL's ``underscore_to_dot`` off: this prompt shows the names with their dots).
"""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import Any

from kvnotes.core.jsontext import first_object
from kvnotes_bench.tools.prompt import CALL_OPENING

_REGISTRY = "bfcl_eval.constants.model_config"
MODEL_NAME = "kvnotes"


@dataclass(frozen=True, slots=True)
class CallCheck:
    """One answer read as a call: parsed or not, and BFCL's verdict where it parsed."""

    parsed: bool
    valid: bool | None  # None: not parsed, the checker was not run
    name: str | None = None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"parsed": self.parsed, "valid": self.valid, "name": self.name,
                "error": self.error}


def parse_call(generated: str) -> dict[str, Any] | None:
    """``{name: arguments}`` of the first complete JSON call in ``CALL_OPENING + generated``."""
    body = first_object(CALL_OPENING + generated)
    if body is None:
        return None
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    name, args = obj.get("name"), obj.get("arguments", obj.get("parameters"))
    if isinstance(name, str) and isinstance(args, dict):
        return {name: args}
    return None


@cache
def _checker() -> Callable[..., dict[str, Any]]:
    try:
        from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
    except ImportError:
        registry = types.ModuleType(_REGISTRY)
        keep_names = types.SimpleNamespace(underscore_to_dot=False)
        registry.MODEL_CONFIG_MAPPING = {MODEL_NAME: keep_names}  # type: ignore[attr-defined]
        saved = sys.modules.get(_REGISTRY)
        sys.modules[_REGISTRY] = registry
        try:
            sys.modules.pop("bfcl_eval.eval_checker.ast_eval.ast_checker", None)
            from bfcl_eval.eval_checker.ast_eval.ast_checker import ast_checker
        finally:
            if saved is None:
                sys.modules.pop(_REGISTRY, None)
            else:
                sys.modules[_REGISTRY] = saved
    return ast_checker


def check_call(generated: str, functions: list[dict[str, Any]],
               ground_truth: list[dict[str, Any]]) -> CallCheck:
    """BFCL's verdict on the call in ``generated`` for a ``live_multiple`` case."""
    call = parse_call(generated)
    if call is None:
        return CallCheck(parsed=False, valid=None)
    from bfcl_eval.constants.enums import Language

    name = next(iter(call))
    try:
        out = _checker()(functions, [call], ground_truth, Language.PYTHON, "live_multiple",
                         MODEL_NAME)
    except Exception as err:  # noqa: BLE001 -- the checker's own failures on odd calls
        return CallCheck(parsed=True, valid=False, name=name,
                         error=f"checker failed: {type(err).__name__}: {err}")
    errors = out.get("error") or []
    return CallCheck(parsed=True, valid=bool(out.get("valid")), name=name,
                     error="; ".join(str(e) for e in errors)[:300] or None)
