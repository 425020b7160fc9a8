"""Fixtures of the front's tests: a loopback stand-in for vLLM (:mod:`_front_fakes`) and the
refunds library the hostile-input suites serve (a module may define its own instead)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from _front_fakes import HEADER, REFUNDS, FakeVLLM

from kvnotes.serving.skills import ServingSkills


@pytest.fixture
def fake() -> Iterator[FakeVLLM]:
    f = FakeVLLM()
    yield f
    f.close()


@pytest.fixture(scope="module")
def upstream() -> Iterator[FakeVLLM]:
    """One fake vLLM for a whole test module."""
    f = FakeVLLM()
    yield f
    f.close()


@pytest.fixture(scope="module")
def published(tmp_path_factory, tiny_llama) -> ServingSkills:
    """The header and the refunds policy behind it, published once per test module."""
    lib = ServingSkills(tmp_path_factory.mktemp("front-skills"), tiny_llama)
    lib.add(HEADER, name="header")
    lib.add(REFUNDS, name="refunds", after=HEADER)
    return lib
