"""Settings that cannot all hold are refused at start, before any model loads: a library cap
below the tenant quotas' sum, a store password given twice."""

from __future__ import annotations

import json

import pytest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.config_file import load_serve_config
from kvnotes.serving.front.config import FrontConfig, LearnConfig


def _keys(tmp_path, tenants):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": {f"sk-{i}": ({"tenant": t} if t else {})
                                         for i, t in enumerate(tenants)}}))
    return path


def test_a_cap_below_the_quotas_sum_is_refused_naming_both(tmp_path):
    keys = _keys(tmp_path, ["acme", "globex", None, "acme"])  # 3 tenants: acme, globex, shared
    learn = LearnConfig(library_cap="2MB", tenant_quota="1MB")
    with pytest.raises(InvalidArgumentError) as err:
        FrontConfig(key_file=keys, learn=learn)
    text = str(err.value)
    assert "library_cap 2M" in text and "sum 3M" in text and "3 tenants x 1M" in text, text


def test_a_cap_that_holds_every_quota_is_accepted(tmp_path):
    keys = _keys(tmp_path, ["acme", "globex", None])
    front = FrontConfig(key_file=keys, learn=LearnConfig(library_cap="3MB", tenant_quota="1MB"))
    assert front.keys.tenants == frozenset({"acme", "globex", None})


def test_without_keys_the_tenants_are_not_known_and_nothing_is_refused():
    learn = LearnConfig(library_cap="1MB", tenant_quota="1MB")
    assert FrontConfig(learn=learn).learn == learn


def test_serve_refuses_the_cap_from_its_file_before_anything_starts(tmp_path):
    keys = _keys(tmp_path, ["acme", "globex"])
    config = tmp_path / "serve.toml"
    config.write_text(f'[auth]\nkey_file = "{keys}"\n[learning]\nenabled = true\n'
                      'library_cap = "1MB"\ntenant_quota = "1MB"\n')
    with pytest.raises(InvalidArgumentError, match="quotas' sum"):
        load_serve_config(config, given={"skills": tmp_path / "s"}, env={}).front_config()


def test_serve_refuses_a_password_both_in_the_url_and_a_file(tmp_path):
    (tmp_path / "pw").write_text("s3cret\n")
    config = tmp_path / "serve.toml"
    config.write_text(f'[store]\nurl = "redis://:hunter2@127.0.0.1:6379/0"\n'
                      f'password_file = "{tmp_path / "pw"}"\n')
    with pytest.raises(InvalidArgumentError) as err:
        load_serve_config(config, given={"skills": tmp_path / "s"}, env={})
    assert "both in the URL and in" in str(err.value) and "hunter2" not in str(err.value)
