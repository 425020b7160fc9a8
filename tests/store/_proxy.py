"""The reply-dropping loopback proxy of the store tests (it lives in the bench package, whose
fleet soak drops a host's replies with it)."""

from kvnotes_bench.serving.redis_proxy import DropProxy

__all__ = ["DropProxy"]
