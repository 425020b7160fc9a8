"""A request's body: read within its size and time limits, parsed as JSON no deeper than
allowed, checked as an OpenAI request (every refusal an :class:`~.errors.ApiError` naming
the limit or the field)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
from typing import NoReturn, TypeAlias

from starlette.requests import Request

from kvnotes.serving.front.config import FrontConfig
from kvnotes.serving.front.errors import ApiError
from kvnotes.serving.json_types import RequestBody
from kvnotes.serving.planning.request import BadRequest, check_body


async def read_body(request: Request, config: FrontConfig) -> bytes:
    """The body, at most ``max_body_bytes`` (413, checked as it comes) within
    ``body_timeout`` (408)."""
    from starlette.requests import ClientDisconnect

    limit = config.max_body_bytes
    too_large = ApiError(413, f"the body is larger than {limit} bytes "
                         "(FrontConfig.max_body_bytes)")
    claimed = request.headers.get("content-length")
    if claimed is not None and claimed.strip().isdigit() and int(claimed) > limit:
        if int(claimed) <= config.max_drain_bytes:
            await _drain(request, config)
        raise too_large
    buf = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            buf.extend(chunk)
            if len(buf) > limit:
                return

    try:
        await asyncio.wait_for(read(), config.body_timeout)
        if len(buf) > limit:
            seen = len(buf)
            buf.clear()
            await _drain(request, config, seen)
            raise too_large
    except TimeoutError as err:
        raise ApiError(408, f"the body did not arrive within {config.body_timeout:g} s") from err
    except ClientDisconnect as err:
        raise ApiError(400, "the client closed the connection before its body ended") from err
    return bytes(buf)


async def _drain(request: Request, config: FrontConfig, seen: int = 0) -> None:
    """Read and discard what is left of a refused body, up to ``max_drain_bytes`` and for at
    most a few seconds (a client that sent it whole then reads its 413, not a reset)."""
    from starlette.requests import ClientDisconnect

    async def drain() -> None:
        total = seen
        async for chunk in request.stream():
            total += len(chunk)
            if total > config.max_drain_bytes:
                return

    # RuntimeError: the body had all come already (Starlette's "stream consumed")
    with contextlib.suppress(TimeoutError, ClientDisconnect, RuntimeError):
        await asyncio.wait_for(drain(), min(config.body_timeout, 5.0))


def parse_body(raw: bytes, kind: str, config: FrontConfig) -> RequestBody:
    """The body's JSON object, checked (400 naming the field): no deeper than
    ``max_json_depth``, every string valid Unicode (:func:`check_values`), every number finite
    and in range, the known fields of the right type and range (``check_body``)."""
    try:
        data = json.loads(raw, parse_constant=no_constant)
    except RecursionError as err:
        raise ApiError(400, "the body's JSON is nested too deeply") from err
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the body is not UTF-8 (byte {err.start})") from err
    except json.JSONDecodeError as err:
        raise ApiError(400, f"the body is not valid JSON: {err.msg} at line {err.lineno} "
                       f"column {err.colno}") from err
    except ValueError as err:  # an integer of more digits than Python converts
        raise ApiError(400, "the body is not valid JSON: a number is too long") from err
    try:
        check_values(data, config.max_json_depth)
        return check_body(kind, data)
    except BadRequest as err:
        raise ApiError(400, str(err), err.param or None) from err


def no_constant(name: str) -> NoReturn:
    """``json.loads``' ``parse_constant``: ``NaN`` and ``Infinity`` are not JSON."""
    raise ValueError(f"{name} is not a JSON number")


INT_RANGE = (-(1 << 63), (1 << 63) - 1)  # what vLLM's fields (seeds, ids, counts) can hold
_SURROGATE = re.compile("[\ud800-\udfff]")
# where a value sits in the body: (the parent's path, its key or index); None: the body itself
_Path: TypeAlias = "tuple[_Path, str | int] | None"


def check_values(value: object, max_depth: int) -> None:
    """Every value of a parsed JSON body: nested at most ``max_depth`` deep, every string (and
    key) valid Unicode (JSON's ``"\\ud800"`` parses to a lone surrogate, which no encoder
    takes), every number finite (``1e999`` parses to infinity) and every integer within
    :data:`INT_RANGE`; :class:`BadRequest` naming the first one that is not. Iterative: a
    deep body cannot exhaust the stack.

    Example:
        >>> try:
        ...     check_values({"messages": [{"content": "\\ud800"}]}, 64)
        ... except BadRequest as err:
        ...     print(err.param, "|", err)
        messages[0].content | messages[0].content is not valid Unicode (a lone surrogate)
    """
    # (value, depth, its path as (parent path, key)): the path's text is built only on error
    stack: list[tuple[object, int, _Path]] = [(value, 1, None)]
    while stack:
        item, depth, path = stack.pop()
        if isinstance(item, dict):
            if depth > max_depth:
                raise BadRequest("", f"the body's JSON is nested deeper than "
                                 f"{max_depth} levels")
            for k, v in item.items():
                if _SURROGATE.search(k):
                    raise BadRequest(_path(path), f"a key of {_path(path) or 'the body'} is "
                                     "not valid Unicode (a lone surrogate)")
                stack.append((v, depth + 1, (path, k)))
        elif isinstance(item, list):
            if depth > max_depth:
                raise BadRequest("", f"the body's JSON is nested deeper than "
                                 f"{max_depth} levels")
            stack.extend((v, depth + 1, (path, i)) for i, v in enumerate(item))
        elif isinstance(item, str):
            if _SURROGATE.search(item):
                raise BadRequest(_path(path), f"{_path(path)} is not valid Unicode (a lone "
                                 "surrogate)")
        elif isinstance(item, bool):
            continue
        elif isinstance(item, int):
            if not INT_RANGE[0] <= item <= INT_RANGE[1]:
                raise BadRequest(_path(path), f"{_path(path)} is out of range (a 64-bit "
                                 "integer)")
        elif isinstance(item, float) and not math.isfinite(item):
            raise BadRequest(_path(path), f"{_path(path)} is not a finite number")


def _path(path: _Path) -> str:
    """``messages[0].content`` of a path ``((None, "messages"), 0), "content")``."""
    keys: list[str | int] = []
    while path is not None:
        path, key = path
        keys.append(key)
    out = ""
    for key in reversed(keys):
        out += f"[{key}]" if isinstance(key, int) else (f".{key}" if out else str(key))
    return out[:120]
