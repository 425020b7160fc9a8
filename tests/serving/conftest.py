"""Fixtures of the front's tests: a loopback stand-in for vLLM (:mod:`_front_fakes`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _front_fakes import FakeVLLM


@pytest.fixture
def fake() -> Iterator[FakeVLLM]:
    f = FakeVLLM()
    yield f
    f.close()
