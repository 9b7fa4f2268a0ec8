"""GPUOptions / ConfigProto, TensorFlow's environment variables and memory limit."""

from __future__ import annotations

import pickle
import types

import numpy as np
import pytest

import gpudash
from gpudash import ConfigError, GpudashWarning
from gpudash.options import (
    ConfigProto,
    GPUOptions,
    allow_growth_from_env,
    cuda_visible_devices,
    garbage_collection_from_env,
    memory_limit,
    min_system_memory,
    normalize_allocator_type,
    parse_device_list,
    resolve_visible_devices,
    simulated_devices_from_env,
)

MiB = 1 << 20
GiB = 1 << 30

FIELDS = [
    "per_process_gpu_memory_fraction",
    "allocator_type",
    "deferred_deletion_bytes",
    "allow_growth",
    "visible_device_list",
    "polling_active_delay_usecs",
    "polling_inactive_delay_msecs",
    "force_gpu_compatible",
]


# -- GPUOptions: fields and defaults ---------------------------------------------------------


def test_public_names_resolve_lazily():
    assert gpudash.GPUOptions is GPUOptions
    assert gpudash.ConfigProto is ConfigProto


def test_defaults_are_tensorflows():
    opts = GPUOptions()
    assert opts.as_dict() == {
        "per_process_gpu_memory_fraction": 0.0,
        "allocator_type": "",
        "deferred_deletion_bytes": 0,
        "allow_growth": False,
        "visible_device_list": "",
        "polling_active_delay_usecs": 0,
        "polling_inactive_delay_msecs": 0,
        "force_gpu_compatible": False,
    }
    assert list(opts.as_dict()) == FIELDS == list(GPUOptions.FIELDS)
    assert repr(opts) == "GPUOptions()"


def test_keyword_dict_and_from_dict_agree():
    a = GPUOptions(allow_growth=True, per_process_gpu_memory_fraction=0.5)
    b = GPUOptions({"allow_growth": True, "per_process_gpu_memory_fraction": 0.5})
    c = GPUOptions.from_dict({"per_process_gpu_memory_fraction": 0.5, "allow_growth": True})
    assert a == b == c
    assert a != GPUOptions()
    assert (a == "x") is False
    # keywords override the source
    assert GPUOptions({"allow_growth": True}, allow_growth=False).allow_growth is False


def test_repr_shows_only_non_defaults_in_proto_order():
    opts = GPUOptions(allow_growth=True, per_process_gpu_memory_fraction=0.5,
                      visible_device_list="1,0")
    assert repr(opts) == (
        "GPUOptions(per_process_gpu_memory_fraction=0.5, allow_growth=True, "
        "visible_device_list='1,0')"
    )


def test_from_tf_reads_attributes():
    tf_like = types.SimpleNamespace(
        per_process_gpu_memory_fraction=0.25, allocator_type="BFC",
        deferred_deletion_bytes=1024, allow_growth=True, visible_device_list="0",
        polling_active_delay_usecs=5, polling_inactive_delay_msecs=2,
        force_gpu_compatible=True, experimental=object(),  # extra attributes are ignored
    )
    opts = GPUOptions.from_tf(tf_like)
    assert opts.as_dict() == {k: getattr(tf_like, k) for k in FIELDS}
    assert GPUOptions(tf_like) == opts  # also accepted positionally
    # an object with only some of the attributes keeps the defaults for the others
    assert GPUOptions(types.SimpleNamespace(allow_growth=True)) == GPUOptions(allow_growth=True)
    # a GPUOptions is itself a valid source (copied)
    copy = GPUOptions(opts)
    assert copy == opts and copy is not opts


def test_from_tf_validates_values():
    with pytest.raises(ConfigError, match="allow_growth must be True or False; got 1"):
        GPUOptions.from_tf(types.SimpleNamespace(allow_growth=1))


def test_bad_source_objects():
    with pytest.raises(ConfigError, match="GPUOptions expects a GPUOptions, a dict"):
        GPUOptions(0.5)
    with pytest.raises(ConfigError, match="from_tf expects an object with GPUOptions attributes"):
        GPUOptions.from_tf(object())
    with pytest.raises(ConfigError, match="from_dict expects a mapping"):
        GPUOptions.from_dict([("allow_growth", True)])


def test_unknown_keys_name_the_key_and_list_the_valid_ones():
    for make in (lambda: GPUOptions(allow_grwoth=True),
                 lambda: GPUOptions({"allow_grwoth": True}),
                 lambda: GPUOptions().copy(allow_grwoth=True)):
        with pytest.raises(ConfigError) as info:
            make()
        msg = str(info.value)
        assert "'allow_grwoth'" in msg
        assert all(f in msg for f in FIELDS)
    opts = GPUOptions()
    with pytest.raises(ConfigError, match="no field 'allow_grwoth'"):
        opts.allow_grwoth = True
    with pytest.raises(ConfigError, match="cannot be deleted"):
        del opts.allow_growth


def test_assignment_validates():
    config = ConfigProto()
    config.gpu_options.per_process_gpu_memory_fraction = 0.5
    assert config.gpu_options.per_process_gpu_memory_fraction == 0.5
    with pytest.raises(ConfigError):
        config.gpu_options.per_process_gpu_memory_fraction = -1
    assert config.gpu_options.per_process_gpu_memory_fraction == 0.5  # unchanged


def test_fraction_message_is_exact():
    with pytest.raises(ConfigError) as info:
        GPUOptions(per_process_gpu_memory_fraction=-0.5)
    assert str(info.value) == (
        "per_process_gpu_memory_fraction must be a number >= 0 (0 = TensorFlow's default, "
        "above 1 = oversubscription through unified memory); got -0.5"
    )


@pytest.mark.parametrize("bad", [-0.5, -1, float("nan"), float("inf"), "0.5", True, None])
def test_fraction_rejects(bad):
    with pytest.raises(ConfigError, match=r"per_process_gpu_memory_fraction must be a number"):
        GPUOptions(per_process_gpu_memory_fraction=bad)


def test_fraction_accepts_ints_numpy_and_above_one():
    assert GPUOptions(per_process_gpu_memory_fraction=1).per_process_gpu_memory_fraction == 1.0
    opts = GPUOptions(per_process_gpu_memory_fraction=np.float32(0.5))
    assert type(opts.per_process_gpu_memory_fraction) is float
    big = GPUOptions(per_process_gpu_memory_fraction=1.5)
    assert big.uses_unified_memory and not opts.uses_unified_memory


@pytest.mark.parametrize(
    ("value", "normalized"),
    [("", "BFC"), ("BFC", "BFC"), ("bfc", "BFC"), ("Bfc", "BFC"),
     ("cuda_malloc", "cuda_malloc"), ("CUDA_MALLOC", "cuda_malloc")],
)
def test_allocator_type(value, normalized):
    opts = GPUOptions(allocator_type=value)
    assert opts.allocator_type == value  # stored as given, like the proto
    assert opts.normalized_allocator_type == normalized
    assert normalize_allocator_type(value) == normalized


@pytest.mark.parametrize("bad", ["best_fit", "cuda_malloc_async", 1, None])
def test_allocator_type_rejects(bad):
    with pytest.raises(ConfigError) as info:
        GPUOptions(allocator_type=bad)
    msg = str(info.value)
    assert msg.startswith("allocator_type must be '' or 'BFC'")
    assert "'cuda_malloc'" in msg and msg.endswith(f"got {bad!r}")
    with pytest.raises(ConfigError):
        normalize_allocator_type(bad)


@pytest.mark.parametrize(
    "field", ["deferred_deletion_bytes", "polling_active_delay_usecs",
              "polling_inactive_delay_msecs"],
)
@pytest.mark.parametrize("bad", [-1, 1.5, 2.0, "8MiB", True, None])
def test_integer_fields_reject(field, bad):
    with pytest.raises(ConfigError) as info:
        GPUOptions(**{field: bad})
    msg = str(info.value)
    assert msg.startswith(f"{field} must be an integer between 0 and ")
    assert msg.endswith(f"got {bad!r}")


def test_integer_fields_ranges():
    assert GPUOptions(deferred_deletion_bytes=np.int64(4096)).deferred_deletion_bytes == 4096
    with pytest.raises(ConfigError, match="between 0 and 2147483647"):
        GPUOptions(polling_active_delay_usecs=1 << 31)
    with pytest.raises(ConfigError, match="between 0 and 9223372036854775807"):
        GPUOptions(deferred_deletion_bytes=1 << 63)


@pytest.mark.parametrize("field", ["allow_growth", "force_gpu_compatible"])
@pytest.mark.parametrize("bad", [1, 0, "true", None])
def test_bool_fields_must_be_bool(field, bad):
    with pytest.raises(ConfigError, match=f"^{field} must be True or False; got {bad!r}$"):
        GPUOptions(**{field: bad})


def test_bool_fields_accept_numpy_bool():
    opts = GPUOptions(allow_growth=np.bool_(True))
    assert opts.allow_growth is True


@pytest.mark.parametrize(
    ("text", "ids"),
    [("", []), ("  ", []), ("0", [0]), ("5,3", [5, 3]), (" 5 , 3 ", [5, 3]),
     ("10,0,2", [10, 0, 2])],
)
def test_visible_device_list(text, ids):
    opts = GPUOptions(visible_device_list=text)
    assert opts.visible_device_list == text
    assert opts.visible_device_ids == ids == parse_device_list(text)


@pytest.mark.parametrize(
    ("bad", "detail"),
    [("5,,3", "bad entry ''"), ("a", "bad entry 'a'"), ("-1", "bad entry '-1'"),
     ("1.0", "bad entry '1.0'"), ("1,2,1", "id 1 repeats"), ("0,", "bad entry ''")],
)
def test_visible_device_list_rejects(bad, detail):
    with pytest.raises(ConfigError) as info:
        GPUOptions(visible_device_list=bad)
    msg = str(info.value)
    assert msg.startswith("visible_device_list must be a comma-separated list")
    assert f"got {bad!r}" in msg and detail in msg


def test_visible_device_list_must_be_a_string():
    with pytest.raises(ConfigError, match="visible_device_list must be a string"):
        GPUOptions(visible_device_list=[0, 1])


def test_effective_values():
    opts = GPUOptions()
    assert opts.effective_deferred_deletion_bytes == 8 * 1048576
    assert opts.effective_polling_active_delay_usecs == 10
    assert opts.effective_polling_inactive_delay_msecs == 100
    assert opts.normalized_allocator_type == "BFC"
    opts = GPUOptions(deferred_deletion_bytes=4096, polling_active_delay_usecs=3,
                      polling_inactive_delay_msecs=7)
    assert opts.effective_deferred_deletion_bytes == 4096
    assert opts.effective_polling_active_delay_usecs == 3
    assert opts.effective_polling_inactive_delay_msecs == 7


def test_copy_and_replace_validate_everything_first():
    opts = GPUOptions(allow_growth=True)
    new = opts.copy(per_process_gpu_memory_fraction=0.3)
    assert new == GPUOptions(allow_growth=True, per_process_gpu_memory_fraction=0.3)
    assert opts.per_process_gpu_memory_fraction == 0.0  # original untouched
    assert opts.replace() == opts and opts.replace() is not opts
    with pytest.raises(ConfigError, match="deferred_deletion_bytes"):
        opts.copy(allow_growth=False, deferred_deletion_bytes=-1)


def test_update_is_all_or_nothing():
    opts = GPUOptions()
    with pytest.raises(ConfigError, match="polling_active_delay_usecs"):
        opts.update(allow_growth=True, polling_active_delay_usecs=-5)
    assert opts == GPUOptions()  # nothing half-applied
    opts.update(allow_growth=True, polling_active_delay_usecs=5)
    assert opts == GPUOptions(allow_growth=True, polling_active_delay_usecs=5)


def test_gpu_options_pickle_and_unhashable():
    opts = GPUOptions(allow_growth=True, visible_device_list="1")
    assert pickle.loads(pickle.dumps(opts)) == opts
    with pytest.raises(TypeError):
        hash(opts)


# -- ConfigProto -----------------------------------------------------------------------------


def test_config_proto_defaults_and_forms():
    config = ConfigProto()
    assert config.gpu_options == GPUOptions()
    assert config.allow_soft_placement is False and config.log_device_placement is False
    assert repr(config) == "ConfigProto()"
    assert ConfigProto({"allow_growth": True}).gpu_options == GPUOptions(allow_growth=True)
    opts = GPUOptions(allow_growth=True)
    assert ConfigProto(opts).gpu_options is opts  # kept, not copied, as in TensorFlow
    tf_gpu = types.SimpleNamespace(allow_growth=True, per_process_gpu_memory_fraction=0.4)
    assert ConfigProto(tf_gpu).gpu_options == GPUOptions(
        allow_growth=True, per_process_gpu_memory_fraction=0.4)


def test_config_proto_repr_eq_as_dict():
    config = ConfigProto(gpu_options={"allow_growth": True}, allow_soft_placement=True,
                         log_device_placement=True)
    assert repr(config) == ("ConfigProto(gpu_options=GPUOptions(allow_growth=True), "
                            "allow_soft_placement=True, log_device_placement=True)")
    d = config.as_dict()
    assert d["gpu_options"]["allow_growth"] is True
    assert d["allow_soft_placement"] is True and d["log_device_placement"] is True
    assert ConfigProto.from_dict(d) == config
    assert config != ConfigProto()
    assert pickle.loads(pickle.dumps(config)) == config


def test_config_proto_from_tf():
    tf_config = types.SimpleNamespace(
        gpu_options=types.SimpleNamespace(allow_growth=True, visible_device_list="0"),
        allow_soft_placement=True, log_device_placement=False, intra_op_parallelism_threads=4,
    )
    config = ConfigProto.from_tf(tf_config)
    assert config == ConfigProto(GPUOptions(allow_growth=True, visible_device_list="0"),
                                 allow_soft_placement=True)
    with pytest.raises(ConfigError, match=r"ConfigProto\.from_tf expects"):
        ConfigProto.from_tf(object())


def test_config_proto_validation():
    with pytest.raises(ConfigError, match="allow_soft_placement must be True or False; got 1"):
        ConfigProto(allow_soft_placement=1)
    with pytest.raises(ConfigError, match="GPUOptions expects"):
        ConfigProto(gpu_options=3)
    with pytest.raises(ConfigError, match="ConfigProto has no field 'gpu_option'"):
        ConfigProto.from_dict({"gpu_option": {}})
    config = ConfigProto()
    with pytest.raises(ConfigError, match="ConfigProto has no field 'session_inter_op'"):
        config.session_inter_op = 1
    config.gpu_options = {"allow_growth": True}  # converted on assignment
    assert isinstance(config.gpu_options, GPUOptions) and config.gpu_options.allow_growth
    config.gpu_options = None
    assert config.gpu_options == GPUOptions()


def test_config_proto_copy_is_deep():
    config = ConfigProto(gpu_options={"allow_growth": True})
    other = config.copy(log_device_placement=True)
    other.gpu_options.allow_growth = False
    assert config.gpu_options.allow_growth is True
    assert other.log_device_placement is True and config.log_device_placement is False
    with pytest.raises(ConfigError):
        config.copy(log_device_placement="yes")


# -- environment -----------------------------------------------------------------------------

OVERRIDE = ("Overriding allow_growth setting because the TF_FORCE_GPU_ALLOW_GROWTH "
            "environment variable is set. Original config value was {}.")


@pytest.mark.parametrize("config_value", [True, False])
def test_allow_growth_unset_keeps_config(config_value, recwarn):
    assert allow_growth_from_env(config_value, environ={}) is config_value
    assert len(recwarn) == 0


@pytest.mark.parametrize(
    ("env", "config_value", "expected"),
    [("true", False, True), ("false", True, False)],
)
def test_allow_growth_forced_with_warning(env, config_value, expected):
    with pytest.warns(GpudashWarning) as record:
        got = allow_growth_from_env(config_value, {"TF_FORCE_GPU_ALLOW_GROWTH": env})
    assert got is expected
    assert [str(w.message) for w in record] == [OVERRIDE.format(config_value)]


@pytest.mark.parametrize(("env", "config_value"), [("true", True), ("false", False)])
def test_allow_growth_forced_to_same_value_is_silent(env, config_value, recwarn):
    assert allow_growth_from_env(config_value, {"TF_FORCE_GPU_ALLOW_GROWTH": env}) is config_value
    assert len(recwarn) == 0


@pytest.mark.parametrize("env", ["True", "1", "yes", "", " true"])
def test_allow_growth_unparsable_keeps_config(env):
    with pytest.warns(GpudashWarning, match="could not be parsed") as record:
        assert allow_growth_from_env(True, {"TF_FORCE_GPU_ALLOW_GROWTH": env}) is True
    assert f'"{env}"' in str(record[0].message)
    assert "Using original config value of True." in str(record[0].message)


def test_allow_growth_reads_os_environ(monkeypatch):
    monkeypatch.setenv("TF_FORCE_GPU_ALLOW_GROWTH", "true")
    with pytest.warns(GpudashWarning):
        assert allow_growth_from_env(False) is True
    monkeypatch.delenv("TF_FORCE_GPU_ALLOW_GROWTH")
    assert allow_growth_from_env(False) is False


def test_garbage_collection(recwarn):
    assert garbage_collection_from_env({}) is True
    assert garbage_collection_from_env({"TF_ENABLE_GPU_GARBAGE_COLLECTION": "false"}) is False
    assert garbage_collection_from_env({"TF_ENABLE_GPU_GARBAGE_COLLECTION": "true"}) is True
    assert len(recwarn) == 0
    with pytest.warns(GpudashWarning, match='could not be parsed: "False".*"true"'):
        assert garbage_collection_from_env({"TF_ENABLE_GPU_GARBAGE_COLLECTION": "False"}) is True


@pytest.mark.parametrize(
    ("env", "expected"),
    [(None, None), ("", []), ("0", [0]), ("0,2", [0, 2]), (" 3 , 1 ", [3, 1]), ("-1", []),
     ("0,-1,2", [0])],
)
def test_cuda_visible_devices(env, expected):
    environ = {} if env is None else {"CUDA_VISIBLE_DEVICES": env}
    assert cuda_visible_devices(environ) == expected


@pytest.mark.parametrize("bad", ["a", "0,,1", "GPU-1234abcd", "1,1", "0.5"])
def test_cuda_visible_devices_rejects(bad):
    with pytest.raises(ConfigError, match="CUDA_VISIBLE_DEVICES") as info:
        cuda_visible_devices({"CUDA_VISIBLE_DEVICES": bad})
    assert repr(bad) in str(info.value)


@pytest.mark.parametrize(
    ("env", "expected"),
    [(None, None), ("  ", None), ("16GiB", [16 * GiB]), ("2x16GiB", [16 * GiB] * 2),
     ("2X8GiB", [8 * GiB] * 2), ("1x8GiB,1x16GiB", [8 * GiB, 16 * GiB]),
     ("8GiB, 16 GiB", [8 * GiB, 16 * GiB]), ("3 x 1GB", [10**9] * 3), ("2*4096", [4096] * 2)],
)
def test_simulated_devices_from_env(env, expected):
    environ = {} if env is None else {"GPUDASH_SIMULATE": env}
    assert simulated_devices_from_env(environ) == expected


@pytest.mark.parametrize("bad", ["lots", "2x", "0x16GiB", "0", "16GiB,,8GiB", "-1x8GiB",
                                 "2y16GiB"])
def test_simulated_devices_from_env_rejects(bad):
    with pytest.raises(ConfigError, match=r"^GPUDASH_SIMULATE must be") as info:
        simulated_devices_from_env({"GPUDASH_SIMULATE": bad})
    assert repr(bad) in str(info.value)


def test_resolve_visible_devices():
    assert resolve_visible_devices("", 3) == [0, 1, 2]
    assert resolve_visible_devices("", 0) == []
    assert resolve_visible_devices("5,3", 8) == [5, 3]
    with pytest.raises(ConfigError) as info:
        resolve_visible_devices("0,2", 2)
    assert "invalid GPU id '2'" in str(info.value)
    assert "visible device count is 2" in str(info.value)
    with pytest.raises(ConfigError, match="visible_device_list must be"):
        resolve_visible_devices("0;1", 2)
    with pytest.raises(ConfigError, match="n_visible"):
        resolve_visible_devices("", -1)


# -- memory limit ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("available", "cc_major", "reserve"),
    [(2 * GiB - 1, 9, 225 * MiB), (1 * GiB, 5, 225 * MiB),
     (2 * GiB, 5, 500 * MiB), (2 * GiB, 6, 500 * MiB), (16 * GiB, 7, 1050 * MiB),
     (16 * GiB, 8, 1536 * MiB), (80 * GiB, 9, 1800 * MiB), (80 * GiB, 10, 1800 * MiB)],
)
def test_min_system_memory(available, cc_major, reserve):
    assert min_system_memory(available, cc_major) == reserve


def test_memory_limit_fraction_zero_subtracts_reserve():
    # 16 GiB free on an Ampere GPU: 16 GiB - 1536 MiB
    assert memory_limit(16 * GiB, 16 * GiB, 0.0, cc_major=8, environ={}) == 15569256448
    # 80 GiB H100 with 79 GiB free: reserve 1800 MiB of the *available* memory
    assert memory_limit(80 * GiB, 79 * GiB, 0, cc_major=9, environ={}) == 79 * GiB - 1800 * MiB
    # less free than the reserve: the reserve is not subtracted
    assert memory_limit(1 * GiB, 200 * MiB, 0.0, environ={}) == 200 * MiB
    assert memory_limit(1 * GiB, 225 * MiB, 0.0, environ={}) == 225 * MiB  # not strictly below
    assert memory_limit(1 * GiB, 226 * MiB, 0.0, environ={}) == 1 * MiB


def test_memory_limit_fraction_uses_total_not_free():
    assert memory_limit(16 * GiB, 4 * GiB, 0.5, environ={}) == 8 * GiB
    assert memory_limit(16 * GiB, 4 * GiB, 1.0, environ={}) == 16 * GiB
    assert memory_limit(1000, 1000, 0.3333, environ={}) == 333  # truncated
    # above 1: oversubscription (unified memory) on Pascal and newer
    assert memory_limit(16 * GiB, 16 * GiB, 1.5, cc_major=6, environ={}) == 24 * GiB
    assert memory_limit("16GiB", "8GiB", 0.25, environ={}) == 4 * GiB


def test_memory_limit_unified_memory_needs_pascal():
    with pytest.raises(ConfigError) as info:
        memory_limit(16 * GiB, 16 * GiB, 1.5, cc_major=5, environ={})
    assert str(info.value).startswith(
        "Unified memory on GPUs with compute capability lower than 6.0 "
        "(pre-Pascal class GPUs) does not support oversubscription.")
    # exactly 1 is fine on an old GPU
    assert memory_limit(16 * GiB, 16 * GiB, 1.0, cc_major=5, environ={}) == 16 * GiB


def test_memory_limit_env_override():
    env = {"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "1024"}
    # overrides the default reserve ...
    assert memory_limit(16 * GiB, 15 * GiB, 0.0, environ=env) == 14 * GiB
    # ... and the fraction too (TensorFlow applies it after both)
    assert memory_limit(16 * GiB, 15 * GiB, 0.5, environ=env) == 14 * GiB
    assert memory_limit(16 * GiB, 15 * GiB, 0.0,
                        environ={"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "0"}) == 15 * GiB
    # empty means unset
    assert memory_limit(16 * GiB, 16 * GiB, 0.0,
                        environ={"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": ""}) == 15569256448


@pytest.mark.parametrize("bad", ["abc", "-5", "1.5"])
def test_memory_limit_env_invalid_is_ignored_with_warning(bad):
    with pytest.warns(GpudashWarning, match=f"reserved device memory {bad} is invalid"):
        got = memory_limit(16 * GiB, 16 * GiB, 0.0,
                           environ={"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": bad})
    assert got == 15569256448


def test_memory_limit_env_too_large_is_ignored_with_warning():
    with pytest.warns(GpudashWarning) as record:
        got = memory_limit(16 * GiB, 2 * GiB, 0.5,
                           environ={"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "4096"})
    assert got == 8 * GiB
    assert str(record[0].message) == (
        "The requested reserved device memory 4.00GiB is larger than the available memory "
        "of 2.00GiB. The request is ignored.")


def test_memory_limit_system_memory_mb_takes_precedence():
    env = {"TF_DEVICE_MIN_SYS_MEMORY_IN_MB": "1024"}
    assert memory_limit(16 * GiB, 15 * GiB, 0.0, system_memory_mb=2048,
                        environ=env) == 13 * GiB
    # 0 means unset (the proto default), so the environment applies
    assert memory_limit(16 * GiB, 15 * GiB, 0.0, system_memory_mb=0, environ=env) == 14 * GiB
    with pytest.raises(ConfigError, match="system_memory_mb must be an integer"):
        memory_limit(16 * GiB, 15 * GiB, 0.0, system_memory_mb=-1, environ={})


def test_memory_limit_validates_inputs():
    with pytest.raises(ConfigError, match="per_process_gpu_memory_fraction must be a number"):
        memory_limit(GiB, GiB, -0.1, environ={})
    with pytest.raises(ConfigError, match="total must be"):
        memory_limit(-1, GiB, 0.5, environ={})
    with pytest.raises(ConfigError, match="available must be"):
        memory_limit(GiB, "lots", 0.5, environ={})
