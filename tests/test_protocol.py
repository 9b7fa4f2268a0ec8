"""The allocator protocol to its end: each model's module supplies its settings' resolution,
its replay loops and its copy; what-if's runners register themselves; the code that serves
every allocator asks the model instead of testing which one it has."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import gpudash
from gpudash import ConfigError
from gpudash.models import BFC, MODELS, TORCH, model_for, register, trace_model
from gpudash.models import base as models_base
from gpudash.trace import whatif
from gpudash.trace.replay import replay, resolve_settings
from gpudash.trace.whatif import Runner, min_fraction, register_runner, runner_for, sweep
from gpudash.trace.workloads import trace_from_calls

pytestmark = pytest.mark.core

GIB = 1 << 30
ROOT = Path(__file__).resolve().parent.parent


def _calls():
    return [("alloc", 1, 3 * GIB), ("alloc", 2, GIB), ("free", 1), ("alloc", 3, 2 * GIB),
            ("free", 2), ("free", 3)]


# ---------------------------------------------------------------------------- no kind checks
#: A test of which allocator a value is (a model's name compared, a model by identity, a
#: local flag for one of them, the old tables by model name).
_KIND_CHECK = re.compile(
    r"""== *['"](torch|bfc)['"]|!= *['"](torch|bfc)['"]|\bis_torch\b"""
    r"""|\bis (not )?(TORCH|BFC)\b|^\s*torch = .*(==|\bis )|_RESOLVE\[|_GRID\[""", re.M)


@pytest.mark.parametrize("path", ["gpudash/trace/replay.py", "gpudash/trace/whatif.py",
                                  "gpudash/cli.py"])
def test_the_code_that_serves_every_allocator_asks_the_model(path):
    text = (ROOT / path).read_text()
    assert _KIND_CHECK.findall(text) == []


def test_each_model_module_supplies_its_loops_and_resolution():
    for model in MODELS.values():
        module = type(model).__module__
        assert module.startswith("gpudash.models.") and module != "gpudash.models.base"
        for compiled in (False, True):
            settings = resolve_settings(allocator=model.name, device_bytes="1GiB")
            run = model.runner(settings, compiled)
            assert run.__module__ == module, (model.name, compiled, run)
    deferred = resolve_settings(allocator="bfc", device_bytes="1GiB",
                                deferred_deletion_bytes="1MiB")
    assert BFC.runner(deferred, False).__name__ == "run_deferred"
    assert TORCH.runner(resolve_settings(allocator="torch"), False).__name__ == "run_torch"


def test_a_setting_of_the_other_model_is_refused_by_its_owner_s_name():
    with pytest.raises(ConfigError, match="is a setting of PyTorch's caching allocator; "
                                          "replay with allocator='torch'"):
        resolve_settings(allocator="bfc", conf="expandable_segments:True")
    with pytest.raises(ConfigError, match="not a setting of PyTorch's caching allocator "
                                          r"\(PyTorch's allocator has no such setting"):
        resolve_settings(allocator="torch", allow_growth=True)


# ---------------------------------------------------------------------------- a third model
def test_a_third_model_registers_itself_and_every_lookup_finds_it():
    @models_base.dataclass(frozen=True, repr=False)
    class _Third(type(BFC)):
        def made(self, meta):
            return meta.get("source") == "third-pool-log"

    third = _Third(name="third", title="a third allocator", frameworks=("thirdfw",),
                   layout="third", region="arena", regions="arenas", pool="pool")
    try:
        register(third, aliases=("rmm-like",))
        assert MODELS["third"] is third
        assert model_for("rmm-like") is third and model_for("thirdfw") is third
        assert trace_model(trace_from_calls(_calls(), meta={"source": "third-pool-log"})) \
            is third
        assert trace_model(trace_from_calls(_calls())) is BFC      # the default stays
        with pytest.raises(ConfigError, match="'third' \\(a third allocator; also"):
            model_for("nonesuch")
    finally:
        MODELS.pop("third", None)
        for alias in [a for a, m in models_base._ALIASES.items() if m is third]:
            del models_base._ALIASES[alias]
    assert "third" not in MODELS and model_for("bfc") is BFC


# ---------------------------------------------------------------------------- cloning
def test_clone_copies_a_bfc_allocator_and_the_copies_are_independent():
    from gpudash.bfc import clone

    dev = gpudash.SimulatedDevice("1GiB")
    a = gpudash.BFCAllocator(dev, 1 << 30)
    ptrs = [a.allocate(n) for n in (1000, 5000, 1 << 20)]
    a.deallocate(ptrs[1])
    b = clone(a, gpudash.SimulatedDevice("1GiB"))
    assert b.snapshot() == a.snapshot() and b.stats() == a.stats()
    before = a.stats()
    b.deallocate(ptrs[0])
    assert a.owns(ptrs[0]) and not b.owns(ptrs[0])
    b.allocate(5000)                      # inside the copied region: no new one
    assert a.stats() == before and b.stats().bytes_in_use != before.bytes_in_use
    assert BFC.clone(a, gpudash.SimulatedDevice("1GiB")).stats() == a.stats()


def test_a_model_without_checkpoints_says_so():
    alloc = TORCH.build(resolve_settings(allocator="torch", device_bytes="1GiB"),
                        gpudash.SimulatedDevice("1GiB"))
    with pytest.raises(NotImplementedError, match="PyTorch's caching allocator"):
        TORCH.clone(alloc, gpudash.SimulatedDevice("1GiB"))


def test_scrubbing_a_replay_uses_the_model_s_clone():
    from gpudash.trace.replay import DeviceIndex, _Engine, _model_calls

    trace = trace_from_calls(_calls())
    assert replay(trace, device_bytes="16GiB").fits

    settings = resolve_settings(trace, device_bytes="16GiB")
    ops, keys, nbytes, _, _ = _model_calls(trace, settings, DeviceIndex(trace))
    eng = _Engine(settings, ops.tolist(), keys.tolist(), nbytes.tolist())
    eng.run_to(4)
    copy = eng.clone()
    eng.run_to(len(ops))
    assert copy.pos == 4 and copy.alloc.stats().bytes_in_use == 3 * GIB
    assert eng.alloc.stats().bytes_in_use == 0


# ---------------------------------------------------------------------------- runners
def test_a_registered_runner_takes_its_client_and_answers_as_in_process():
    trace = trace_from_calls(_calls())
    seen = []

    class Client:
        pass

    def run_sweep(client, jobs, settings, calls, report):
        seen.append(("sweep", client, len(settings)))
        return whatif._here_sweep(None, 1, settings, calls, report)

    def run_bisect(client, jobs, *args):
        seen.append(("bisect", client))
        return whatif._here_bisect(None, 1, *args)

    mine = Client()
    runner = register_runner(Runner("test-client", lambda client, jobs: client is mine,
                                    run_sweep, run_bisect))
    try:
        assert runner_for(mine, 1) is runner and runner_for(None, 1).name == "here"
        assert runner_for(None, 3).name == "processes"
        local = min_fraction(trace, "8GiB", tolerance=0.01)
        remote = min_fraction(trace, "8GiB", tolerance=0.01, client=mine)
        assert (remote.fraction, remote.history) == (local.fraction, local.history)
        table = sweep(trace, fractions=[0.3, 0.6], device_bytes="8GiB", client=mine)
        assert table.rows == sweep(trace, fractions=[0.3, 0.6], device_bytes="8GiB").rows
    finally:
        whatif._RUNNERS.remove(runner)
    assert [s[0] for s in seen] == ["bisect", "sweep"] and seen[0][1] is mine


def test_what_if_imports_no_runner_until_a_client_comes():
    code = (
        "import sys\n"
        "from gpudash.trace.whatif import sweep\n"
        "from gpudash.trace.workloads import trace_from_calls\n"
        "t = trace_from_calls([('alloc', 1, 1 << 30), ('free', 1)])\n"
        "sweep(t, fractions=[0.5], device_bytes='4GiB')\n"
        "print('dask' in ' '.join(m for m in sys.modules if m.startswith('gpudash.dask')))\n"
        "try:\n"
        "    sweep(t, fractions=[0.5], device_bytes='4GiB', client=object())\n"
        "except TypeError as exc:\n"
        "    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    first, second = out.stdout.strip().splitlines()
    assert first == "False"
    # a client no registered runner takes: the Dask runner registers itself and refuses it
    assert second == "client must be a distributed.Client; got object"
