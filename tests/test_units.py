"""Byte parsing and formatting, including TensorFlow's HumanReadableNumBytes."""

from __future__ import annotations

import numpy as np
import pytest

from gpudash import ConfigError
from gpudash._units import format_bytes, human_readable_num_bytes, parse_bytes


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (0, 0),
        (4096, 4096),
        (np.int64(7), 7),
        (2.0**30, 1 << 30),
        ("4096", 4096),
        (" 4096 ", 4096),
        ("0", 0),
        ("512B", 512),
        ("8KiB", 8192),
        ("512MiB", 512 << 20),
        ("16GiB", 16 << 30),
        ("16 GiB", 16 << 30),
        ("16gib", 16 << 30),
        ("16GIB", 16 << 30),
        ("1.5GiB", 1610612736),
        (".5KiB", 512),
        ("1TiB", 1 << 40),
        ("2PiB", 2 << 50),
        ("2GB", 2_000_000_000),
        ("2gb", 2_000_000_000),
        ("3KB", 3000),
        ("1.5MB", 1_500_000),
        ("1e3", 1000),
        ("0.1GiB", 107374182),  # 107374182.4 rounded down
    ],
)
def test_parse_bytes_accepts(text, expected):
    assert parse_bytes(text) == expected
    assert type(parse_bytes(text)) is int


@pytest.mark.parametrize(
    "bad",
    [True, False, -1, -0.5, float("nan"), float("inf"), 1.5, "", "   ", "-1GiB", "1.5.2GiB",
     "GiB", "16 GiBs", "16 gigabytes", "16Gi", "0x10", "1,5GiB", None, [1], b"16GiB"],
)
def test_parse_bytes_rejects(bad):
    with pytest.raises(ConfigError) as info:
        parse_bytes(bad)
    msg = str(info.value)
    assert repr(bad) in msg
    assert "'512MiB'" in msg and "KiB" in msg and "GB" in msg


def test_parse_bytes_names_the_setting():
    with pytest.raises(ConfigError, match=r"^capacity must be .*; got 'lots'$"):
        parse_bytes("lots", name="capacity")


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0 B"),
        (512, "512 B"),
        (1023, "1023 B"),
        (1024, "1.00 KiB"),
        (1536, "1.50 KiB"),
        (1048575, "1.00 MiB"),  # 1023.999 KiB rounds up: the unit moves up too
        (16 << 30, "16.00 GiB"),
        (1610612736, "1.50 GiB"),
        (1 << 40, "1.00 TiB"),
        (-1536, "-1.50 KiB"),
        (-5, "-5 B"),
    ],
)
def test_format_bytes(n, expected):
    assert format_bytes(n) == expected


def test_format_bytes_rejects_non_numbers():
    with pytest.raises(TypeError):
        format_bytes("1GiB")
    with pytest.raises(TypeError):
        format_bytes(True)


@pytest.mark.parametrize(
    ("n", "expected"),
    [
        (0, "0B"),
        (1, "1B"),
        (1023, "1023B"),
        (1024, "1.0KiB"),
        (4096, "4.0KiB"),
        (1536, "1.5KiB"),
        (1048575, "1024.0KiB"),
        (1048576, "1.00MiB"),
        (18874368, "18.00MiB"),
        (256 << 20, "256.00MiB"),
        (1610612736, "1.50GiB"),
        (1 << 30, "1.00GiB"),
        ((1 << 30) - 1, "1024.00MiB"),  # integer division keeps it in MiB
        (1 << 40, "1.00TiB"),
        (1 << 50, "1.00PiB"),
        ((1 << 63) - 1, "8.00EiB"),
        (-1, "-1B"),
        (-4096, "-4.0KiB"),
        (-18874368, "-18.00MiB"),
        (-(1 << 63), "-8E"),
        # integer division drops the low bits before the final /1024.0
        (1053819, "1.00MiB"),  # exact: 1.0050001 MiB would print 1.01,
    ],
)
def test_human_readable_num_bytes_matches_tensorflow(n, expected):
    assert human_readable_num_bytes(n) == expected


def test_human_readable_num_bytes_range_and_type():
    with pytest.raises(ValueError, match="int64"):
        human_readable_num_bytes(1 << 63)
    with pytest.raises(TypeError):
        human_readable_num_bytes(1.5)
    assert human_readable_num_bytes(np.int64(4096)) == "4.0KiB"


@pytest.mark.parametrize("value", ["1e999999", 2 ** 63, "9000000PB", float(2 ** 64)])
def test_byte_counts_beyond_int64_are_refused_before_any_huge_number_is_made(value):
    from gpudash._units import MAX_BYTES, parse_bytes

    with pytest.raises(ConfigError, match=f"at most {MAX_BYTES} bytes"):
        parse_bytes(value, name="the size")
