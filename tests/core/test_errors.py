"""The error family: every user-facing error is a KvnotesError; unknown names list the valid ones."""

from __future__ import annotations

import pickle

import pytest

from kvnotes.core import errors
from kvnotes.core.errors import KvnotesError, UnknownNameError, UnknownSkillError
from kvnotes.core.tiny import tiny_config


def test_every_error_class_is_a_kvnotes_error():
    classes = [v for v in vars(errors).values() if isinstance(v, type)
               and issubclass(v, BaseException)]
    assert len(classes) > 10
    assert all(issubclass(c, KvnotesError) for c in classes)


def test_unknown_name_lists_the_valid_names_and_survives_pickling():
    err = UnknownNameError("policy", "magic", ("in-place", "erratum"), "see --help")
    assert str(err) == "unknown policy 'magic'; valid policies: in-place, erratum (see --help)"
    assert (err.kind, err.name, err.valid) == ("policy", "magic", ("in-place", "erratum"))
    assert isinstance(err, ValueError)
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is UnknownNameError and str(again) == str(err)


def test_unknown_skill_is_also_a_key_error_with_a_readable_message():
    err = UnknownSkillError("teleport", ["refunds", "tools"])
    assert str(err) == "unknown skill 'teleport'; valid skills: refunds, tools"
    assert isinstance(err, KeyError) and isinstance(err, UnknownNameError)
    assert str(pickle.loads(pickle.dumps(err))) == str(err)


def test_unknown_tiny_arch():
    with pytest.raises(UnknownNameError, match=r"^unknown arch 'nope'; valid archs: .*llama.* "
                                               r"\(no tiny recipe for it\)$"):
        tiny_config("nope", 100)
