"""One family of user-facing errors. Messages say what went wrong and how to fix the call.

Every error kvnotes raises on bad input or a missing resource is defined here. Subclasses also
derive from the builtin a caller would expect (``ValueError``, ``KeyError``, ...), so existing
``except ValueError`` clauses keep working.
"""

from __future__ import annotations

from collections.abc import Iterable


class KvnotesError(Exception):
    """Base class for every error kvnotes raises on bad input or a missing resource."""


class UnknownModelError(KvnotesError, ValueError):
    """A model alias, directory or file that cannot be resolved."""


class NotebookMismatchError(KvnotesError, ValueError):
    """A notebook used with (or loaded into) a model other than the one that wrote it."""


class NotebookFileError(KvnotesError, OSError):
    """A notebook or skill file that is truncated, tampered with or not a kvnotes file."""


class PositionError(KvnotesError, ValueError):
    """Positions outside what the model supports, or a shift the position scheme cannot do."""


class UnsupportedModelError(KvnotesError, ValueError):
    """An architecture or position scheme kvnotes cannot handle for the requested operation."""


class EmptyInputError(KvnotesError, ValueError):
    """Empty text, ids or documents where at least one token is required."""


class UnknownFieldError(KvnotesError, KeyError):
    """A field name that the document or notebook does not have."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else ""


class UnknownNameError(KvnotesError, ValueError):
    """A name that is not one of a fixed set (strategy, selector, family, policy, anchor, alias,
    arch, erratum template, skill, request kind); the message lists the valid names.

    Example:
        >>> str(UnknownNameError("strategy", "redo", ["prefix", "erratum"]))
        "unknown strategy 'redo'; valid strategies: prefix, erratum"
    """

    def __init__(self, kind: str, name: object, valid: Iterable[object], hint: str = "") -> None:
        self.kind, self.name, self.hint = kind, name, hint
        self.valid = tuple(str(v) for v in valid)
        plural = (kind[:-2] + "es" if kind.endswith("is")  # axis -> axes
                  else kind[:-1] + "ies" if kind.endswith("y")
                  else kind + "es" if kind.endswith(("s", "x"))
                  else kind + "s")
        message = f"unknown {kind} {name!r}; valid {plural}: {', '.join(self.valid)}"
        super().__init__(message + (f" ({hint})" if hint else ""))

    def __str__(self) -> str:  # a KeyError subclass would repr() the message
        return str(self.args[0]) if self.args else ""

    def __reduce__(self) -> tuple[object, ...]:  # picklable although __init__ takes other arguments than args
        return (type(self), (self.kind, self.name, self.valid, self.hint))


class UnknownSkillError(UnknownNameError, KeyError):
    """A skill name that the skill library does not have."""

    def __init__(self, name: object, valid: Iterable[object]) -> None:
        super().__init__("skill", name, valid)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.valid))


class EmptyAnswerError(KvnotesError, ValueError):
    """An answer choice with no tokens (decisions read an answer's first token)."""


class AnswerTokenError(KvnotesError, ValueError):
    """Answer choices that share their first token, so first-token logits cannot tell them apart."""


class TraceLengthError(KvnotesError, ValueError):
    """Old and new field values that tokenize to different lengths (patching needs them equal)."""


class ServingError(KvnotesError, RuntimeError):
    """A server that cannot be reached, fails to start, or does not serve the model."""


class WorkerError(KvnotesError, RuntimeError):
    """A worker process of a parallel run failed (an error in a case, or the process died)."""


class InvalidArgumentError(KvnotesError, ValueError):
    """An argument with a value the call cannot take (a range, a vocabulary, a text encoding)."""


class ArgumentTypeError(InvalidArgumentError, TypeError):
    """An argument of the wrong type (a float where an integer is needed, None for text, ...)."""


class UnsafePathError(KvnotesError, ValueError):
    """A path kvnotes refuses to write: not a plain child of its folder, a link, or a file
    where a folder is expected (and the other way round)."""


class StoreUnavailableError(ServingError):
    """A shared skill store (Redis) that cannot be reached, answers too slowly, or refuses a
    write (full, read-only, loading); ``reason`` names which, as the store's fault counter does.
    Requests are served without the store meanwhile (computed exactly)."""

    def __init__(self, reason: str, message: str) -> None:
        self.reason = reason
        super().__init__(message)

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.reason, str(self.args[0]) if self.args else ""))
