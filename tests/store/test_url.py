"""``--store``'s spelling: folders, redis:// and rediss:// URLs, passwords, clear errors."""

from __future__ import annotations

import pytest

from kvnotes.core.errors import InvalidArgumentError, UnknownNameError
from kvnotes.serving.store import FolderStore, parse_store_url, store_from_url
from kvnotes.serving.store.redis_store import RedisStore


def test_urls_parse_with_defaults_and_a_masked_password():
    u = parse_store_url("redis://cache")
    assert (u.scheme, u.host, u.port, u.db, u.password) == ("redis", "cache", 6379, 0, None)
    u = parse_store_url("rediss://user:p%40ss@10.0.0.5:6380/3")
    assert (u.scheme, u.port, u.db, u.password) == ("rediss", 6380, 3, "p@ss")
    assert u.display == "rediss://user:***@10.0.0.5:6380/3"
    assert parse_store_url("/srv/skills").path == "/srv/skills"
    assert parse_store_url("file:///srv/skills").path == "/srv/skills"


@pytest.mark.parametrize(("url", "message"), [
    ("redis://cache:99999/0", "the port is not a number"),
    ("redis://cache:6379/zero", "the database 'zero' is not a number"),
    ("redis:///0", "no host"),
    ("file://otherhost/x", "names a local folder"),
])
def test_bad_urls_say_what_is_wrong(url, message):
    with pytest.raises(InvalidArgumentError, match=message):
        parse_store_url(url)


def test_an_unknown_scheme_lists_the_valid_ones():
    with pytest.raises(UnknownNameError, match=r"^unknown store scheme 'memcached'; valid store "
                                               r"schemes: redis, rediss, file"):
        parse_store_url("memcached://x")


def test_a_password_in_the_url_never_shows_in_an_error():
    with pytest.raises(InvalidArgumentError) as err:
        parse_store_url("redis://:hunter2@cache:port/0")
    assert "hunter2" not in str(err.value)


def test_store_from_url_makes_each_store_and_reads_a_password_file(tmp_path):
    assert isinstance(store_from_url(str(tmp_path)), FolderStore)
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    store = store_from_url("redis://127.0.0.1:1/0", password_file=secret)
    assert isinstance(store, RedisStore) and "s3cret" not in store.url
    assert store.client.connection_pool.connection_kwargs["password"] == "s3cret"
    with pytest.raises(InvalidArgumentError, match="both in the URL and in"):
        store_from_url("redis://:a@127.0.0.1:1/0", password_file=secret)
    secret.write_text("")
    with pytest.raises(InvalidArgumentError, match="is empty"):
        store_from_url("redis://127.0.0.1:1/0", password_file=secret)
    with pytest.raises(InvalidArgumentError, match="is for a redis:// store"):
        store_from_url(str(tmp_path), password_file=secret)


def test_the_password_reaches_a_server_that_requires_one(own_redis, tmp_path):
    own_redis.client().config_set("requirepass", "s3cret")
    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    assert store_from_url(own_redis.url, password_file=secret).ping()
    wrong = store_from_url(own_redis.url.replace("redis://", "redis://:nope@"))
    assert not wrong.ping() and wrong.faults.to_dict()["auth"] == 1
