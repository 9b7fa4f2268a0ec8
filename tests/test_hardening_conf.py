"""PYTORCH_CUDA_ALLOC_CONF read by PyTorch's own tokenizer and number rules (issue 34).

From 2.8 PyTorch reads the string with ``ConfigTokenizer`` (c10/core/AllocatorConfig.h):
C whitespace dropped, numbers by ``std::stoull`` (``toSizeT``) and ``std::stod``
(``toDouble``), separators only required to be there (``checkToken``'s result is unread);
``AcceleratorAllocatorConfig::parseArgs`` (c10/core/AllocatorConfig.cpp) reads its keys, then
``CUDAAllocatorConfig::parseArgs`` (c10/cuda/CUDAAllocatorConfig.cpp) refuses unknown ones.
Before 2.8: ``lexArgs`` (spaces only), ``consumeToken`` (separators checked), ``stoi``.

Every expectation below was also checked against torch 2.13.0's own parser: a C++ program
built on the CPU wheel's headers and libc10.so called
``AcceleratorAllocatorConfig::instance().parseArgs`` on each string and printed the parsed
values (a CPU build registers no CUDA pass, so unknown keys are judged from
CUDAAllocatorConfig.cpp). 2.13's answer is in each row's comment; 80,000 random strings
from the fuzz grammar gave no difference either.
"""

import pytest

from gpudash import _accel

from gpudash import ConfigError
from gpudash._torch_conf import CachingAllocatorConfig

MiB = 1 << 20
UNLIMITED = ((1 << 64) - 1) // MiB * MiB   # min(val, SIZE_MAX / kMB) * kMB

# (string, attribute, expected value or an error's words)
ROWS_2_11 = [
    # toSizeT = std::stoull: optional sign, ASCII digits from the start, the rest ignored
    ("max_split_size_mb:+128", "max_split_size", 128 * MiB),       # 2.13: 134217728
    ("max_split_size_mb:128MB", "max_split_size", 128 * MiB),      # 2.13: 134217728
    ("max_split_size_mb:128.0", "max_split_size", 128 * MiB),      # 2.13: 134217728
    ("max_split_size_mb:0x80", "max_split_size", "too small"),     # stoull reads "0"; 2.13: >= 20
    ("max_split_size_mb:1e3", "max_split_size", "too small"),      # stoull reads "1"
    ("max_split_size_mb:١٢٨", "max_split_size", "stoull"),         # 2.13: invalid_argument stoull
    ("max_split_size_mb:-1", "max_split_size", UNLIMITED),         # stoull: 2**64 - 1
    ("max_split_size_mb:-18446744073709551615", "max_split_size", "too small"),  # -> 1
    ("max_split_size_mb:18446744073709551616", "max_split_size", "out_of_range"),  # 2.13: stoull
    ("max_split_size_mb:" + "9" * 5000, "max_split_size", "out_of_range"),
    # ConfigTokenizer drops std::isspace characters, inside tokens too
    ("max_split_size_mb: 1 2 8", "max_split_size", 128 * MiB),     # 2.13: 134217728
    ("\tmax_split_size_mb\n:\r128\v\f", "max_split_size", 128 * MiB),
    ("max_split_size_mb:\u00a0128", "max_split_size", "stoull"),   # U+00A0 is no C space
    # checkToken(++i, ":") / checkToken(++i, ",") results are unread
    ("max_split_size_mb,128", "max_split_size", 128 * MiB),        # 2.13: 134217728
    ("max_split_size_mb:128:expandable_segments:True", "expandable_segments", True),
    ("max_split_size_mb:128,", "max_split_size", 128 * MiB),
    # ... but checkIndex still asserts the token is there
    ("max_split_size_mb", "max_split_size", "Index out of bounds"),  # 2.13: INTERNAL ASSERT
    ("max_split_size_mb:", "max_split_size", "Index out of bounds"),
    ("max_split_size_mb:,", "max_split_size", "stoull"),           # stoull(",")
    ("max_split_size_mb:[128]", "max_split_size", "stoull"),
    ("", "max_split_size", None),
    # toDouble = std::stod (strtod, "C" locale)
    ("garbage_collection_threshold:0x1p-1", "garbage_collection_threshold", 0.5),  # hex float
    ("garbage_collection_threshold:5e-1x", "garbage_collection_threshold", 0.5),
    ("garbage_collection_threshold:.5", "garbage_collection_threshold", 0.5),
    ("garbage_collection_threshold:0.5_0", "garbage_collection_threshold", 0.5),   # stops at _
    ("garbage_collection_threshold:1_0", "garbage_collection_threshold", "(0.0, 1.0)"),  # 1
    ("garbage_collection_threshold:٠.٥", "garbage_collection_threshold", "stod"),
    ("garbage_collection_threshold:1e-310", "garbage_collection_threshold", "out_of_range"),
    ("garbage_collection_threshold:0x1p-1074", "garbage_collection_threshold", 5e-324),  # exact
    ("garbage_collection_threshold:nan", "garbage_collection_threshold", "(0.0, 1.0)"),
    ("garbage_collection_threshold:.", "garbage_collection_threshold", "stod"),
    # parseRoundUpPower2Divisions: values and interval starts by toSizeT
    ("roundup_power2_divisions:+8", "roundup_power2_divisions", (8,) * 16),
    ("roundup_power2_divisions:[256MB:2,>:4x]", "roundup_power2_divisions",
     (2,) * 9 + (4,) * 7),                                         # 2.13: 2 x9, 4 x7
    ("roundup_power2_divisions:[256,1]", "roundup_power2_divisions", (1,) * 9 + (0,) * 7),
    ("roundup_power2_divisions:[256:1:512:2]", "roundup_power2_divisions",
     (1,) * 9 + (2,) + (0,) * 6),
    ("roundup_power2_divisions:[-256:1]", "roundup_power2_divisions", "intervals have to be"),
    ("roundup_power2_divisions:[256:-1]", "roundup_power2_divisions", "power of 2 or 0"),
    ("roundup_power2_divisions:[256:1", "roundup_power2_divisions", "Index out of bounds"),
    ("roundup_power2_divisions:[256:1,", "roundup_power2_divisions", "closing bracket"),
    ("roundup_power2_divisions:[256:1]]", "roundup_power2_divisions", (1,) * 9 + (0,) * 7),
    # toBool: exactly True or False
    ("expandable_segments:true", "expandable_segments", "Expected 'True' or 'False' at index 2"),
    ("expandable_segments,True", "expandable_segments", True),     # 2.13: es=1
    # 2.13: INTERNAL ASSERT "Index out of bounds" (skipKey of 'False'); refused either way
    ("expandable_segments:True:False", "expandable_segments", "Unrecognized key 'False'"),
    # CUDAAllocatorConfig::parseArgs: "Unrecognized key '...' in CUDA allocator config."
    ("expandable_segments:True,foo:1", "expandable_segments", "Unrecognized key 'foo'"),
    ("expandable_segments:True,,max_split_size_mb:128", "expandable_segments",
     "Unrecognized key ','"),
]


@pytest.mark.parametrize("conf, attr, expected", ROWS_2_11)
def test_conf_strings_read_as_pytorch_2_11_reads_them(conf, attr, expected):
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as exc:
            CachingAllocatorConfig(conf)
        assert expected in str(exc.value)
        assert "Traceback" not in str(exc.value)
    else:
        assert getattr(CachingAllocatorConfig(conf), attr) == expected


ROWS_2_7 = [
    # lexArgs drops spaces only; consumeToken checks separators; stoi for MiB and divisions
    ("max_split_size_mb:+128", "max_split_size", 128 * MiB),
    ("max_split_size_mb:128MB", "max_split_size", 128 * MiB),
    ("max_split_size_mb:١٢٨", "max_split_size", "stoi"),
    ("max_split_size_mb:2147483648", "max_split_size", "out_of_range"),   # beyond int
    ("max_split_size_mb:-1", "max_split_size", UNLIMITED),                # (size_t)-1
    ("max_split_size_mb,128", "max_split_size", "expected ':'"),
    ("max_split_size_mb:\t128", "max_split_size", 128 * MiB),             # stoi skips it
    ("\tmax_split_size_mb:128", "max_split_size", "unrecognized key"),
    ("roundup_power2_divisions:[256MB:2]", "roundup_power2_divisions",
     (2,) * 9 + (0,) * 7),                                                # stoul reads 256
]


@pytest.mark.parametrize("conf, attr, expected", ROWS_2_7)
def test_conf_strings_read_as_pytorch_2_7_reads_them(conf, attr, expected):
    if isinstance(expected, str):
        with pytest.raises(ConfigError) as exc:
            CachingAllocatorConfig(conf, version="2.7")
        assert expected in str(exc.value)
    else:
        assert getattr(CachingAllocatorConfig(conf, version="2.7"), attr) == expected


def test_a_refused_string_changes_nothing():
    c = CachingAllocatorConfig("max_split_size_mb:128,expandable_segments:True")
    with pytest.raises(ConfigError):
        c.apply("max_split_size_mb:256,garbage_collection_threshold:1e-310")
    assert c.max_split_size == 128 * MiB and c.garbage_collection_threshold == 0.0


@pytest.mark.core
@pytest.mark.skipif(not _accel.COMPILED, reason="the compiled core is not built")
@pytest.mark.parametrize("setting", [("strings-2.11", "2.11"), ("strings-2.7", "2.7")])
def test_random_conf_strings_give_a_config_or_a_config_error_alike_in_both_cores(setting):
    """benchmarks/fuzz_core.py's conf family, small: strings from PyTorch's grammar and
    their mutants; a ConfigError or settings, the same in both cores."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import fuzz_core

    assert fuzz_core.fuzz_conf(1500, 5, setting, check_every=500) >= 1500
