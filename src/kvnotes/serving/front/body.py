"""A request's body: read within its size and time limits, parsed as JSON no deeper than
allowed, checked as an OpenAI request (every refusal an :class:`~.errors.ApiError` naming
the limit or the field)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from starlette.requests import Request

from kvnotes.serving.front.config import FrontConfig
from kvnotes.serving.front.errors import ApiError
from kvnotes.serving.planning.request import BadRequest, check_body


async def read_body(request: Request, config: FrontConfig) -> bytes:
    """The body, at most ``max_body_bytes`` (413, checked as it comes) within
    ``body_timeout`` (408)."""
    from starlette.requests import ClientDisconnect

    limit = config.max_body_bytes
    claimed = request.headers.get("content-length")
    if claimed is not None and claimed.strip().isdigit() and int(claimed) > limit:
        raise ApiError(413, f"the body is larger than {limit} bytes")
    buf = bytearray()

    async def read() -> None:
        async for chunk in request.stream():
            buf.extend(chunk)
            if len(buf) > limit:
                raise ApiError(413, f"the body is larger than {limit} bytes")

    try:
        await asyncio.wait_for(read(), config.body_timeout)
    except TimeoutError as err:
        raise ApiError(408, f"the body did not arrive within {config.body_timeout:g} s") from err
    except ClientDisconnect as err:
        raise ApiError(400, "the client closed the connection before its body ended") from err
    return bytes(buf)


def parse_body(raw: bytes, kind: str, config: FrontConfig) -> dict[str, Any]:
    """The body's JSON object, checked (400 naming the field)."""
    try:
        data = json.loads(raw, parse_constant=no_constant)
    except RecursionError as err:
        raise ApiError(400, "the body's JSON is nested too deeply") from err
    except ValueError as err:  # UnicodeDecodeError too
        raise ApiError(400, f"the body is not valid JSON: {str(err)[:200]}") from err
    if json_depth(data) > config.max_json_depth:
        raise ApiError(400, f"the body's JSON is nested deeper than "
                       f"{config.max_json_depth} levels")
    try:
        return check_body(kind, data)
    except BadRequest as err:
        raise ApiError(400, str(err), err.param or None) from err


def no_constant(name: str) -> Any:
    """``json.loads``' ``parse_constant``: ``NaN`` and ``Infinity`` are not JSON."""
    raise ValueError(f"{name} is not a JSON number")


def json_depth(value: Any) -> int:
    """The nesting depth of a JSON value (a scalar: 0), without recursion.

    Example:
        >>> json_depth({"a": [1, {"b": 2}]}), json_depth(3)
        (3, 0)
    """
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item.values())
        elif isinstance(item, list):
            deepest = max(deepest, depth)
            stack.extend((v, depth + 1) for v in item)
    return deepest

