"""Argument checks at the public boundary: small pure functions, one clear error each.

Every check raises a :class:`~kvnotes.core.errors.KvnotesError` subclass whose message names the
argument and says how to fix the call (:class:`ArgumentTypeError` for a wrong type,
:class:`InvalidArgumentError` for a value out of range, :class:`EmptyInputError` for no text).
Public methods call one of the ``*_args`` functions on their first line, so a bad argument fails
before any tensor is touched instead of deep inside torch or the tokenizer.

Example:
    >>> integer(3, "start", minimum=0)
    3
    >>> integer(1.5, "start")
    Traceback (most recent call last):
    ...
    kvnotes.core.errors.ArgumentTypeError: start must be an integer, got 1.5 (float); pass int(...)
"""

from __future__ import annotations

import numbers
import string
from collections.abc import Iterable, Sequence
from typing import Any

import torch

from kvnotes.core.errors import (
    ArgumentTypeError,
    EmptyInputError,
    InvalidArgumentError,
    PositionError,
)

# Positions and shifts beyond this fit no model (and overflow int64 arithmetic long before);
# the position adapter still checks the model's own maximum.
MAX_POSITION = 2**31 - 1
MODEL_DTYPES = ("float32", "float16", "bfloat16", "float64")


# ---- single values ------------------------------------------------------------------------
def integer(value: object, name: str, *, minimum: int | None = None,
            maximum: int | None = None) -> int:
    """``value`` as an int; a float, bool, str or None is refused rather than truncated."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not value.is_floating_point() \
            and value.dtype != torch.bool:
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ArgumentTypeError(f"{name} must be an integer, got {value!r} "
                                f"({type(value).__name__}); pass int(...)")
    value = int(value)
    if minimum is not None and value < minimum:
        raise InvalidArgumentError(f"{name} must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise InvalidArgumentError(f"{name} must be <= {maximum}, got {value}")
    return value


def position(value: object, name: str) -> int:
    """A start position or offset: an integer in ``[0, MAX_POSITION]``."""
    value = integer(value, name)
    if not 0 <= value <= MAX_POSITION:
        raise PositionError(f"{name}={value} is outside [0, {MAX_POSITION}]; positions start at 0")
    return value


def shift(value: object, name: str = "delta") -> int:
    """A position shift: an integer no larger in size than ``MAX_POSITION``."""
    value = integer(value, name)
    if abs(value) > MAX_POSITION:
        raise PositionError(f"{name}={value} is larger than any position a model has "
                            f"(|{name}| <= {MAX_POSITION}); shift by a smaller amount")
    return value


def text(value: object, name: str, *, allow_empty: bool = True) -> str:
    """A str that encodes to UTF-8 (no unpaired surrogates); None or bytes are refused."""
    if not isinstance(value, str):
        hint = "; decode bytes first (.decode('utf-8'))" if isinstance(value, bytes) else ""
        raise ArgumentTypeError(f"{name} must be a str, got {type(value).__name__}{hint}")
    if not allow_empty and not value:
        raise EmptyInputError(f"{name} is empty; give at least one character of text")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise InvalidArgumentError(
            f"{name} contains an unpaired surrogate {value[err.start]!r} at index {err.start}; "
            "it cannot be tokenized: fix the text's decoding (errors='replace')") from err
    return value


def flag(value: object, name: str, *, allow_none: bool = False) -> bool | None:
    if value is None and allow_none:
        return None
    if not isinstance(value, bool):
        raise ArgumentTypeError(f"{name} must be True or False, got {value!r}")
    return value


def choice(value: object, name: str, valid: Iterable[object]) -> Any:
    valid = tuple(valid)
    if value not in valid:
        raise InvalidArgumentError(f"{name} must be one of {', '.join(map(repr, valid))}; "
                                   f"got {value!r}")
    return value


def vocab_size(engine: Any) -> int:
    """The number of rows of the model's input embedding (the ids it can take)."""
    return int(engine.model.get_input_embeddings().num_embeddings)


def token_ids(ids: object, name: str, vocab: int) -> list[int]:
    """Integer ids in ``[0, vocab)``; a float tensor or an id outside the vocabulary is refused
    before it reaches the embedding."""
    if isinstance(ids, torch.Tensor):
        if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
            raise ArgumentTypeError(f"{name} must be an integer tensor of token ids, got {ids.dtype}")
        values = ids.reshape(-1).tolist()
    else:
        if not isinstance(ids, Iterable) or isinstance(ids, str | bytes):
            raise ArgumentTypeError(f"{name} must be a list or tensor of token ids, got "
                                    f"{type(ids).__name__}")
        values = list(ids)
        for i, v in enumerate(values):
            if isinstance(v, bool) or not isinstance(v, numbers.Integral):
                raise ArgumentTypeError(f"{name}[{i}] must be an integer token id, got {v!r} "
                                        f"({type(v).__name__})")
    out = [int(v) for v in values]
    bad = [(i, v) for i, v in enumerate(out) if not 0 <= v < vocab]
    if bad:
        i, v = bad[0]
        raise InvalidArgumentError(f"{name}[{i}]={v} is not a token id of this model (valid: 0 to "
                                   f"{vocab - 1}); {len(bad)} id(s) out of range")
    return out


def _is_document(x: object) -> bool:
    # duck-typed: document.py imports this module, so it cannot be imported here
    return callable(getattr(x, "tokenize", None)) and hasattr(x, "parts")


def _is_notebook(x: object) -> bool:
    return callable(getattr(x, "keys", None)) and hasattr(x, "positions") and hasattr(x, "spans")


def token_input(engine: Any, x: object, name: str, *, allow_none: bool = False) -> None:
    """Anything the engine tokenizes: text, a Document, or token ids (list or LongTensor)."""
    if x is None:
        if allow_none:
            return
        raise ArgumentTypeError(f"{name} is None; give text, a kvnotes.Document or token ids")
    if isinstance(x, str):
        text(x, name)
    elif _is_document(x):
        return  # checked when the Document was built
    elif isinstance(x, (torch.Tensor, Sequence)) and not isinstance(x, (bytes, bytearray)):
        token_ids(x, name, vocab_size(engine))
    else:
        raise ArgumentTypeError(f"{name} must be text, a kvnotes.Document or token ids, got "
                                f"{type(x).__name__}")


def notebook(nb: object, name: str = "nb") -> None:
    if not _is_notebook(nb):
        hint = "; call .dequantize() first" if type(nb).__name__ == "QuantizedNotebook" else ""
        raise ArgumentTypeError(f"{name} must be a kvnotes.Notebook, got {type(nb).__name__}{hint}")


def not_bare_string(parts: object, name: str, example: str) -> None:
    """Refuse a bare str where a list of parts is expected (it would split into characters)."""
    if isinstance(parts, (str, bytes)):
        raise ArgumentTypeError(f"{name} must be a list of parts, not a bare string (it would "
                                f"become one part per character); wrap it: {example}")


# ---- documents ----------------------------------------------------------------------------
def document_parts(parts: object, field_type: type[Any]) -> tuple[Any, ...]:
    """The parts of a Document as a tuple: str or ``field_type``, field names and values str."""
    not_bare_string(parts, "Document parts", "Document([text])")
    if parts is None or not isinstance(parts, Iterable):
        raise ArgumentTypeError(f"Document parts must be a list of str and Field, got "
                                f"{type(parts).__name__}")
    out = tuple(parts)
    names = [p.name for p in out if isinstance(p, field_type)]
    if len(names) != len(set(names)):
        raise InvalidArgumentError(f"field names must be unique in a document, got {names}; "
                                   "rename the repeated field")
    for i, p in enumerate(out):
        if isinstance(p, field_type):
            text(p.name, f"Document part {i} field name", allow_empty=False)
            text(p.value, f"field {p.name!r} value")
        elif isinstance(p, str):
            text(p, f"Document part {i}")
        else:
            raise ArgumentTypeError(f"Document part {i} must be a str or kvnotes.Field, got "
                                    f"{type(p).__name__}")
    return out


def erratum_template(template: object) -> str:
    """A format string whose placeholders are only {label}, {Label}, {old} and {new}."""
    allowed = ("label", "Label", "old", "new")
    template = text(template, "template", allow_empty=False)
    try:
        names = [f for _, f, _, _ in string.Formatter().parse(template) if f is not None]
    except ValueError as err:
        raise InvalidArgumentError(f"erratum template {template!r} is not a valid format "
                                   f"string ({err}); escape braces as {{{{ and }}}}") from err
    unknown = [f for f in names if f not in allowed]
    if unknown:
        raise InvalidArgumentError(f"erratum template {template!r} has unknown placeholder(s) "
                                   f"{unknown}; use only {{label}}, {{Label}}, {{old}}, {{new}}")
    return template


# ---- engine verbs (one call on the first line of each) ------------------------------------
def prefill_args(engine: Any, x: object, start: object, bos: object, name: object) -> None:
    token_input(engine, x, "x")
    position(start, "start")
    flag(bos, "bos", allow_none=True)
    text(name, "name")


def extend_args(engine: Any, nb: object, x: object) -> None:
    notebook(nb)
    token_input(engine, x, "x")


def compile_args(text_: object, name: object) -> None:
    text(text_, "text", allow_empty=False)
    text(name, "name")


def compose_args(engine: Any, parts: object, start: object) -> None:
    not_bare_string(parts, "compose parts", "engine.compose([text])")
    if not isinstance(parts, Sequence):
        raise ArgumentTypeError(f"compose parts must be a list of str, Document or Notebook, got "
                                f"{type(parts).__name__}; wrap a single part in a list")
    position(start, "start")
    for i, part in enumerate(parts):
        if isinstance(part, str):
            text(part, f"compose part {i}")
        elif not (_is_document(part) or _is_notebook(part)):
            raise ArgumentTypeError(f"compose part {i} must be a str, Document or Notebook, got "
                                    f"{type(part).__name__}")


def query_args(engine: Any, nb: object, query: object) -> None:
    notebook(nb)
    token_input(engine, query, "query", allow_none=True)


def greedy_args(engine: Any, nb: object, query: object, max_new_tokens: object,
                stop: object = ()) -> None:
    query_args(engine, nb, query)
    integer(max_new_tokens, "max_new_tokens", minimum=1)
    # a bare string would stop at any of its characters
    not_bare_string(stop, "stop", 'stop=["\\n"]')
    if not isinstance(stop, Sequence) or not all(isinstance(s, str) and s for s in stop):
        raise ArgumentTypeError(f"stop must be a list of non-empty strings, got {stop!r}")


def layer_index(value: object, num_layers: int, name: str = "layer") -> int:
    """A layer index in ``[0, num_layers)`` (negative indices are refused, not wrapped)."""
    return integer(value, name, minimum=0, maximum=num_layers - 1)


def batch_size(value: object, name: str = "batch_size") -> int:
    return integer(value, name, minimum=1)


def answer(engine: Any, value: object, name: str) -> None:
    """An answer: text, or a token id of the model (text without tokens is the decision
    code's own EmptyAnswerError)."""
    if isinstance(value, str):
        text(value, name)
    elif isinstance(value, numbers.Integral) and not isinstance(value, bool):
        vocab = vocab_size(engine)
        if not 0 <= int(value) < vocab:  # a negative id would silently read logits[-1]
            raise InvalidArgumentError(f"{name}={value} is not a token id of this model (valid: "
                                       f"0 to {vocab - 1})")
    else:
        raise ArgumentTypeError(f"{name} must be text or a token id, got {value!r}")


def answers(engine: Any, values: object, name: str = "answers") -> None:
    """A list of answers (not a bare string), each non-empty text or an in-vocabulary id."""
    not_bare_string(values, name, f"{name}=[first, second]")
    if not isinstance(values, Sequence):
        raise ArgumentTypeError(f"{name} must be a list of answers, got {type(values).__name__}")
    for i, a in enumerate(values):
        answer(engine, a, f"{name}[{i}]")


# ---- models -------------------------------------------------------------------------------
def model_dtype(dtype: object) -> torch.dtype:
    """A floating dtype a model can be loaded in, from a torch.dtype or its name."""
    if isinstance(dtype, str):
        key = dtype.removeprefix("torch.")
        if key in MODEL_DTYPES:
            return getattr(torch, key)
    elif isinstance(dtype, torch.dtype) and str(dtype).removeprefix("torch.") in MODEL_DTYPES:
        return dtype
    raise InvalidArgumentError(f"dtype must be one of {', '.join(MODEL_DTYPES)} (a str or "
                               f"torch.dtype), got {dtype!r}")


def model_device(device: object) -> torch.device:
    """A device that exists on this machine, checked before any weights are loaded."""
    if not isinstance(device, (str, torch.device)):
        raise ArgumentTypeError(f"device must be a str such as 'cpu' or 'cuda:0', got {device!r}")
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as err:
        raise InvalidArgumentError(f"device {device!r} is not a torch device name ({err}); use "
                                   "'cpu', 'cuda', 'cuda:0', 'mps'") from err
    if dev.type == "meta":
        raise InvalidArgumentError("device 'meta' holds no weights; use 'cpu' or 'cuda'")
    try:
        torch.empty(0, device=dev)
    except Exception as err:  # torch raises RuntimeError or AssertionError by backend
        raise InvalidArgumentError(f"device {device!r} is not available on this machine "
                                   f"({str(err).splitlines()[0] if str(err) else type(err).__name__})"
                                   "; use 'cpu'") from err
    return dev


# ---- ops verbs ----------------------------------------------------------------------------
def edit_args(engine: Any, nb: object, field: object, new_value: object, *, k: object,
              layer: object, chat: object = None) -> None:
    """``kvnotes.edit``: a notebook, a field name, a text value, an int budget, a layer index."""
    flag(chat, "chat", allow_none=True)
    notebook(nb)
    text(field, "field", allow_empty=False)
    text(new_value, "new_value")
    integer(k, "k", minimum=0)
    layer_index(layer, engine.adapter.num_layers)


def trace_args(engine: Any, doc: object, field: object, new_value: object, query: object,
               answers: object, batch_size_: object) -> None:
    """``kvnotes.trace``: a Document, text field and value, a query, two answers, a batch size."""
    if not _is_document(doc):
        raise ArgumentTypeError(f"doc must be a kvnotes.Document, got {type(doc).__name__}")
    text(field, "field", allow_empty=False)
    text(new_value, "new_value")
    token_input(engine, query, "query")
    not_bare_string(answers, "answers", "answers=(new_answer, old_answer)")
    if isinstance(answers, Sequence) and len(answers) == 2:
        for i, a in enumerate(answers):
            answer(engine, a, f"answers[{i}]")
    batch_size(batch_size_)
