"""OpenAI-shaped error answers, and header values that are always safe to send.

Every error the front answers is ``{"error": {"message", "type", "param", "code"}}`` with the
status that fits (:data:`ERROR_TYPES`), the shape vLLM and OpenAI answer with.
"""

from __future__ import annotations

import re

from kvnotes.serving.json_types import ErrorBody

ERROR_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
    405: "MethodNotAllowed", 408: "RequestTimeout", 413: "RequestTooLarge",
    429: "RateLimitError", 500: "InternalServerError", 502: "BadGateway",
    503: "ServiceUnavailable", 504: "GatewayTimeout",
}
_UNSAFE = re.compile(r"[^\x20-\x7e]")


class ApiError(Exception):
    """An error answer: ``status`` and an OpenAI-shaped body (see :func:`error_body`)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param = status, param


def error_body(status: int, message: str, param: str | None = None) -> ErrorBody:
    """The OpenAI error object.

    Example:
        >>> error_body(401, "no key")["error"]["type"]
        'AuthenticationError'
    """
    return {"error": {"message": message, "type": ERROR_TYPES.get(status, "Error"),
                      "param": param, "code": status}}


def header_value(text: str, limit: int = 200) -> str:
    """``text`` as a header value: printable ASCII only (anything else escaped as
    ``\\uXXXX``, CR and LF included), at most ``limit`` characters.

    Example:
        >>> header_value("forwarded: field ['tenänt\\r\\nx: 1']")
        "forwarded: field ['ten\\\\u00e4nt\\\\u000d\\\\u000ax: 1']"
    """
    safe = _UNSAFE.sub(lambda m: f"\\u{ord(m.group()):04x}", text)
    return safe[:limit]
