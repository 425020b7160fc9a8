"""One size rule for every option: K/M/G/T are powers of 1000, KiB/MiB/GiB/TiB of 1024."""

from __future__ import annotations

import pytest

from kvnotes.core.errors import InvalidArgumentError
from kvnotes.core.sizes import format_size, parse_size


@pytest.mark.parametrize(("text", "size"), [
    ("64M", 64_000_000), ("64MB", 64_000_000), ("64mb", 64_000_000),
    ("64MiB", 67_108_864), ("64Mi", 67_108_864), ("64mib", 67_108_864),
    ("1K", 1000), ("1KiB", 1024), ("2GB", 2_000_000_000), ("1GiB", 1_073_741_824),
    ("1T", 10**12), ("1TiB", 2**40), ("4096", 4096), ("4096B", 4096), (" 8 KiB ", 8192),
    ("1.5k", 1500), ("0.5KiB", 512), ("1.5GB", 1_500_000_000),
])
def test_sizes_have_exact_values(text, size):
    assert parse_size(text) == size


def test_an_int_is_bytes():
    assert parse_size(4096) == 4096


@pytest.mark.parametrize(("value", "message"), [
    ("lots", "--library-cap 'lots' is not a size: give e.g. 268435456, 256MiB or 2GB"),
    ("64X", "--library-cap '64X': unknown unit 'X'; use B, K, M, G, T (powers of 1000) or "
            "KiB, MiB, GiB, TiB (powers of 1024)"),
    ("64MiBs", "unknown unit 'MiBs'"),
    ("0.5B", "--library-cap '0.5B' is 0.5 bytes: give a whole number of bytes"),
    ("1.0001K", "is 1000.1000 bytes: give a whole number of bytes"),
    ("0", "--library-cap '0': give a positive number of bytes"),
    (0, "--library-cap 0: give a positive number of bytes"),
    ("-1M", "is not a size"),
    ("1e6", "is not a size"),
    (True, "--library-cap True: give a number of bytes"),
    (1.5, "--library-cap 1.5: give a number of bytes"),
])
def test_bad_sizes_are_refused_naming_the_setting(value, message):
    with pytest.raises(InvalidArgumentError) as err:
        parse_size(value, "--library-cap")
    assert message in str(err.value)


def test_the_cli_and_the_library_read_sizes_alike():
    from pathlib import Path

    from kvnotes.serving.config_file import load_serve_config
    from kvnotes.serving.front.config import LearnConfig

    cli = load_serve_config(None, given={
        "skills": Path("x"), "learning.enabled": True, "learning.library_cap": "64M",
        "learning.tenant_quota": "64MiB"}, env={}).learn_config()
    assert cli is not None
    assert (cli.library_cap, cli.tenant_quota) == (64_000_000, 67_108_864)
    lib = LearnConfig(library_cap="64M", tenant_quota="64MiB")  # type: ignore[arg-type]
    assert (lib.library_cap, lib.tenant_quota) == (cli.library_cap, cli.tenant_quota)


@pytest.mark.parametrize(("size", "text"), [
    (67_108_864, "64MiB"), (64_000_000, "64M"), (1024, "1KiB"), (1000, "1K"),
    (1_024_000, "1000KiB"), (2**40, "1TiB"), (1500, "1500"), (7, "7")])
def test_a_size_is_spelled_in_its_largest_whole_unit_and_read_back(size, text):
    assert format_size(size) == text
    assert parse_size(text) == size
