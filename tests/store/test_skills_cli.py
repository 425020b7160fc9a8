"""``kvnotes skills list/pin/forget --store URL`` on a real Redis, and ``--store``'s plumbing."""

from __future__ import annotations

import pytest
from _store_helpers import MODEL
from typer.testing import CliRunner

from kvnotes.cli import app
from kvnotes.cli.store_options import open_store
from kvnotes.core.errors import InvalidArgumentError
from kvnotes.serving.store import FolderStore
from kvnotes.serving.store.redis_store import RedisStore

runner = CliRunner()


@pytest.fixture
def filled(redis_url, make_entry) -> RedisStore:
    store = RedisStore.connect(redis_url)
    store.put(make_entry("aaaaaa01reg", None, learned=False, name="header"))
    store.put(make_entry("bbbbbb02acme", "acme", seed=1))
    store.put(make_entry("cccccc03globex", "globex", seed=2))
    return store


def test_list_shows_every_entry_or_what_one_tenant_sees(redis_url, filled):
    result = runner.invoke(app, ["skills", "list", "--store", redis_url])
    assert result.exit_code == 0, result.output
    rows = {line.split("\t")[-1]: line for line in result.stdout.strip().splitlines()}
    assert set(rows) == {"aaaaaa01reg", "bbbbbb02acme", "cccccc03globex"}
    assert rows["aaaaaa01reg"].startswith(f"{MODEL}\theader\t") and "\tregistered\t" in \
        rows["aaaaaa01reg"]
    assert "tenant acme" in rows["bbbbbb02acme"] and "\tevictable\t" in rows["bbbbbb02acme"]
    result = runner.invoke(app, ["skills", "list", "--store", redis_url, "--tenant", "acme"])
    assert {line.split("\t")[-1] for line in result.stdout.strip().splitlines()} == {
        "aaaaaa01reg", "bbbbbb02acme"}


def test_pin_and_forget_by_key_prefix(redis_url, filled):
    result = runner.invoke(app, ["skills", "pin", "bbbbbb02", "--store", redis_url])
    assert result.exit_code == 0, result.output
    assert result.stdout == "bbbbbb02acme\tpinned\n"
    assert [i.pinned for i in filled.list(MODEL, "acme") if i.key == "bbbbbb02acme"] == [True]
    result = runner.invoke(app, ["skills", "forget", "bbbbbb", "--store", redis_url])
    assert result.stdout == "bbbbbb02acme\tforgotten\n"
    assert filled.get(MODEL, "bbbbbb02acme", "acme") is None


@pytest.mark.parametrize(("args", "message"), [
    (["skills", "forget", "aaaaaa01"], "is a registered skill (header), not a learned one"),
    (["skills", "pin", "zzzzzz99"], "no entry 'zzzzzz99' in redis://127.0.0.1"),
    (["skills", "pin", "abc"], "'abc' is not an entry key"),
])
def test_mistakes_are_usage_errors_naming_the_fix(redis_url, filled, args, message):
    result = runner.invoke(app, [*args, "--store", redis_url])
    assert result.exit_code == 2 and message in " ".join(result.output.split()), result.output


def test_a_store_that_is_down_is_a_runtime_error(own_redis):
    url = own_redis.url
    own_redis.stop()
    result = runner.invoke(app, ["skills", "list", "--store", url])
    assert result.exit_code == 1
    out = " ".join(result.output.split())
    assert "failed (down: " in out and "is the server running and reachable?" in out


def test_neither_skills_nor_store_says_which_to_give():
    result = runner.invoke(app, ["skills", "pin", "abcdef12"])
    assert result.exit_code == 2 and "give --skills DIR" in " ".join(result.output.split())


def test_open_store_gives_the_folder_or_the_shared_store(tmp_path, redis_url):
    assert isinstance(open_store(None, skills=tmp_path), FolderStore)
    assert not isinstance(open_store(redis_url), FolderStore)
    with pytest.raises(InvalidArgumentError, match="--store-password-file is for a --store"):
        open_store(None, tmp_path / "pw", skills=tmp_path)
