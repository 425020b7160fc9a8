"""``--store``'s spelling: folders, redis:// and rediss:// URLs, passwords, clear errors."""

from __future__ import annotations

import pytest

from kvnotes.core.errors import InvalidArgumentError, StoreUnavailableError, UnknownNameError
from kvnotes.serving.store import FolderStore, parse_store_url, store_from_url
from kvnotes.serving.store.redis_store import RedisSettings, RedisStore


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


@pytest.mark.parametrize("url", [
    "redis://:hunter#2x@cache:6379/0",
    "redis://:hunter/2x@cache:6379/0",
    "redis://:hunter?2x@cache:6379/0",
    "redis://admin:hunter#2x@cache:port/0",
    "rediss://:hunter2x@cache:0/0",
])
def test_a_password_with_reserved_characters_never_shows_in_an_error(url):
    with pytest.raises(InvalidArgumentError) as err:
        parse_store_url(url)
    assert "hunter" not in str(err.value) and "2x" not in str(err.value)
    assert "***@cache" in str(err.value)


def test_a_password_with_reserved_characters_says_how_to_write_it():
    with pytest.raises(InvalidArgumentError, match=r"percent-encode it \(%2F, %3F, %23\)"):
        parse_store_url("redis://:a#b@cache:6379/0")
    assert parse_store_url("redis://:a%23b%2Fc%3F@cache:6379/0").password == "a#b/c?"


def test_url_options_and_port_zero_are_refused():
    with pytest.raises(InvalidArgumentError, match=r"URL options \('\?socket_timeout=30&db=3'\) "
                                                   "are not read"):
        parse_store_url("redis://cache:6379/0?socket_timeout=30&db=3")
    with pytest.raises(InvalidArgumentError, match="port 0 is no server's port"):
        parse_store_url("redis://cache:0/0")


def test_conflicting_passwords_are_refused_by_the_check_before_start(tmp_path):
    from kvnotes.serving.store.url import check_store  # what a command calls before loading

    secret = tmp_path / "pw"
    secret.write_text("s3cret\n")
    with pytest.raises(InvalidArgumentError, match="both in the URL and in") as err:
        check_store("redis://:hunter2x@127.0.0.1:1/0", secret)
    assert "hunter2x" not in str(err.value)
    assert check_store("redis://127.0.0.1:1/0", secret).password == "s3cret"
    with pytest.raises(InvalidArgumentError, match="cannot read it"):
        check_store("redis://127.0.0.1:1/0", tmp_path / "missing")


def test_tls_to_a_server_without_tls_is_named(own_redis):
    store = store_from_url(own_redis.url.replace("redis://", "rediss://"), settings=RedisSettings(
        socket_timeout_s=0.3, connect_timeout_s=0.3, retries=0))
    with pytest.raises(StoreUnavailableError) as err:
        store.list("m0del")
    assert err.value.reason == "tls" and "TLS handshake failed" in str(err.value)
    assert store.faults.to_dict()["tls"] == 1
