"""NVML facts: the real library on this machine, and the query logic against a small fake."""

from __future__ import annotations

import os
import pickle
import types

import pytest

from gpudash import ConfigError, nvml
from gpudash.devices import CudaMemory, SimulatedDevice
from gpudash.nvml import NA, DeviceFacts, device_facts, nvml_available, simulated_facts

GiB = 1 << 30


class FakeNVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


class FakeNVML:
    """Just enough of pynvml: two devices; ``broken`` names functions that fail."""

    NVMLError = FakeNVMLError
    NVML_ERROR_LIBRARY_NOT_FOUND = 12
    NVML_ERROR_DRIVER_NOT_LOADED = 9

    def __init__(self, init_error=None, broken=(), processes=None):
        self.init_error = init_error
        self.broken = set(broken)
        self.processes = processes
        self.inits = 0
        self.shutdowns = 0

    def _check(self, name):
        if name in self.broken:
            raise FakeNVMLError(3)  # NVML_ERROR_NOT_SUPPORTED

    def nvmlInit(self):
        self.inits += 1
        if self.init_error is not None:
            raise FakeNVMLError(self.init_error)

    def nvmlShutdown(self):
        self.shutdowns += 1

    def nvmlDeviceGetCount(self):
        self._check("nvmlDeviceGetCount")
        return 2

    def nvmlDeviceGetHandleByIndex(self, i):
        self._check(f"handle{i}")
        return ("handle", i)

    def nvmlDeviceGetName(self, h):
        self._check("nvmlDeviceGetName")
        return b"NVIDIA A100-SXM4-40GB" if h[1] == 0 else "NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h):
        self._check("nvmlDeviceGetUUID")
        return f"GPU-0000000{h[1]}"

    def nvmlDeviceGetMemoryInfo(self, h):
        self._check("nvmlDeviceGetMemoryInfo")
        total = 40 * GiB if h[1] == 0 else 80 * GiB
        return types.SimpleNamespace(total=total, free=total - 3 * GiB, used=3 * GiB)

    def nvmlDeviceGetComputeRunningProcesses(self, h):
        self._check("nvmlDeviceGetComputeRunningProcesses")
        if self.processes is not None:
            return self.processes
        me = os.getpid()
        return [types.SimpleNamespace(pid=me, usedGpuMemory=GiB),
                types.SimpleNamespace(pid=me + 1, usedGpuMemory=2 * GiB)]

    def nvmlDeviceGetCudaComputeCapability(self, h):
        self._check("nvmlDeviceGetCudaComputeCapability")
        return (8, 0) if h[1] == 0 else (9, 0)


@pytest.fixture
def use_fake():
    made = []

    def install(fake):
        nvml._use_library(fake)
        made.append(fake)
        return fake

    yield install
    nvml._use_library(None)


# -- the real library on this machine -------------------------------------------------------


def test_real_nvml_reports_a_fact_not_a_crash():
    ok, reason = nvml_available()
    assert isinstance(ok, bool)
    facts = device_facts()
    if ok:
        assert reason == "" and all(f.source == "nvml" for f in facts)
    else:
        assert reason and facts == []


@pytest.mark.skipif(CudaMemory.available()[0], reason="this machine has a GPU")
def test_real_nvml_without_driver():
    assert nvml_available() == (False, "NVML library not found (no NVIDIA driver)")
    assert device_facts() == []
    assert device_facts(0) == []


@pytest.mark.gpu
@pytest.mark.skipif(not CudaMemory.available()[0], reason="needs CUDA")
def test_real_nvml_facts_present():
    assert nvml_available() == (True, "")
    facts = device_facts()
    assert len(facts) >= 1
    f = facts[0]
    assert f.index == 0 and f.source == "nvml"
    assert isinstance(f.name, str) and f.name
    assert f.uuid.startswith(("GPU-", "MIG-"))
    assert f.total > 0 and f.used + f.free <= f.total + (1 << 20)
    assert isinstance(f.compute_capability, tuple) and f.compute_capability[0] >= 3
    assert device_facts(0)[0].uuid == f.uuid


# -- NA ----------------------------------------------------------------------------------------


def test_na_sentinel():
    assert repr(NA) == "N/A" and str(NA) == "N/A"
    assert not NA and bool(NA) is False
    assert type(NA)() is NA
    assert f"{NA:>5}" == "  N/A" and f"{NA:,d}" == "N/A"
    assert pickle.loads(pickle.dumps(NA)) is NA


# -- the fake --------------------------------------------------------------------------------


def test_facts_from_fake(use_fake):
    fake = use_fake(FakeNVML())
    assert nvml_available() == (True, "")
    facts = device_facts()
    assert facts == [
        DeviceFacts(index=0, name="NVIDIA A100-SXM4-40GB", uuid="GPU-00000000",
                    total=40 * GiB, free=37 * GiB, used=3 * GiB, process_used=GiB,
                    compute_capability=(8, 0), source="nvml"),
        DeviceFacts(index=1, name="NVIDIA H100 80GB HBM3", uuid="GPU-00000001",
                    total=80 * GiB, free=77 * GiB, used=3 * GiB, process_used=GiB,
                    compute_capability=(9, 0), source="nvml"),
    ]
    assert device_facts(1) == facts[1:]
    assert fake.inits == 1  # initialised once
    with pytest.raises(ConfigError, match=r"NVML sees 2 device\(s\)\); got 2"):
        device_facts(2)


def test_init_happens_once_and_shutdown_resets(use_fake):
    fake = use_fake(FakeNVML())
    for _ in range(3):
        nvml_available()
        device_facts()
    assert fake.inits == 1
    nvml._shutdown()
    assert fake.shutdowns == 1
    device_facts()
    assert fake.inits == 2


@pytest.mark.parametrize(
    ("code", "reason"),
    [(12, "NVML library not found (no NVIDIA driver)"),
     (9, "NVIDIA driver not loaded"),
     (4, "no permission to use NVML"),
     (999, "NVML could not be initialised: NVML error 999")],
)
def test_init_failure_reasons(use_fake, code, reason):
    fake = use_fake(FakeNVML(init_error=code))
    assert nvml_available() == (False, reason)
    assert device_facts() == []
    assert nvml_available() == (False, reason)
    assert fake.inits == 1  # the failure is cached too


@pytest.mark.parametrize(
    ("broken", "na_fields"),
    [({"nvmlDeviceGetName"}, {"name"}),
     ({"nvmlDeviceGetUUID"}, {"uuid"}),
     ({"nvmlDeviceGetMemoryInfo"}, {"total", "free", "used"}),
     ({"nvmlDeviceGetComputeRunningProcesses"}, {"process_used"}),
     ({"nvmlDeviceGetCudaComputeCapability"}, {"compute_capability"})],
)
def test_a_failing_query_gives_na_for_that_field_only(use_fake, broken, na_fields):
    use_fake(FakeNVML(broken=broken))
    facts = device_facts()
    assert len(facts) == 2
    for f in facts:
        for field in ("name", "uuid", "total", "free", "used", "process_used",
                      "compute_capability"):
            value = getattr(f, field)
            if field in na_fields:
                assert value is NA, field
            else:
                assert value is not NA, field


def test_missing_function_gives_na(use_fake):
    fake = FakeNVML()
    fake.nvmlDeviceGetCudaComputeCapability = None  # an old pynvml: not callable
    use_fake(fake)
    assert device_facts()[0].compute_capability is NA


def test_failing_handle_gives_an_all_na_row(use_fake):
    use_fake(FakeNVML(broken={"handle1"}))
    facts = device_facts()
    assert facts[0].name == "NVIDIA A100-SXM4-40GB"
    assert facts[1] == DeviceFacts(1, NA, NA, NA, NA, NA, NA, NA, "nvml")


def test_failing_count_gives_no_devices(use_fake):
    use_fake(FakeNVML(broken={"nvmlDeviceGetCount"}))
    assert nvml_available() == (True, "")
    assert device_facts() == []


@pytest.mark.parametrize(
    ("processes", "expected"),
    [([], 0),
     ([types.SimpleNamespace(pid=-7, usedGpuMemory=GiB)], 0),  # someone else's
     ([types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=None)], NA),  # not available
     ([types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=GiB),
       types.SimpleNamespace(pid=os.getpid(), usedGpuMemory=GiB)], 2 * GiB)],
)
def test_process_used(use_fake, processes, expected):
    use_fake(FakeNVML(processes=processes))
    assert device_facts(0)[0].process_used == expected


def test_simulated_facts():
    dev = SimulatedDevice(16 * GiB, index=1, compute_capability=(9, 0))
    dev.alloc(GiB)
    f = simulated_facts(dev)
    assert (f.index, f.name, f.total, f.free, f.used, f.process_used) == (
        1, "sim1", 16 * GiB, 15 * GiB, GiB, GiB)
    assert f.compute_capability == (9, 0) and f.source == "simulated"
    assert f.uuid.startswith("SIM-")
    assert simulated_facts(SimulatedDevice(GiB, index=1)).uuid == f.uuid  # stable
    assert simulated_facts(SimulatedDevice(GiB)).uuid != f.uuid


def test_gpudash_info_lists_nvml_devices_and_unreadable_fields(use_fake, capsys):
    from gpudash.cli import main

    use_fake(FakeNVML(broken={"nvmlDeviceGetMemoryInfo"}))
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "NVML: 2 GPU(s)" in out
    assert "NVIDIA H100 80GB HBM3" in out
    assert "total N/A" in out  # a query NVML refused is a fact, not a crash
    assert "this process 1.00 GiB" in out


# -- the process list (the fake tests formatting and merging only) ---------------------------


class FakeNVMLProcesses(FakeNVML):
    """The fake with graphics processes and process names, to test how gpudash formats and
    merges NVML's lists; it does not test NVML."""

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):
        self._check("nvmlDeviceGetGraphicsRunningProcesses")
        me = os.getpid()
        return [types.SimpleNamespace(pid=me + 1, usedGpuMemory=2 * GiB),  # also compute
                types.SimpleNamespace(pid=me + 2, usedGpuMemory=None)]

    def nvmlSystemGetProcessName(self, pid):
        if pid == os.getpid():
            raise FakeNVMLError(3)  # falls back to /proc/PID/comm
        return b"trainer"


def test_gpu_processes_merge_and_mark(use_fake):
    use_fake(FakeNVMLProcesses())
    procs = nvml.gpu_processes(framework="jax")
    assert set(procs) == {0, 1}
    rows = procs[0]
    me = os.getpid()
    assert [(r.pid, r.kind, r.used) for r in rows] == [
        (me + 1, "compute+graphics", 2 * GiB), (me, "compute", GiB),
        (me + 2, "graphics", NA)]
    mine = rows[1]
    assert mine.is_self and mine.framework == "jax"
    with open(f"/proc/{me}/comm") as f:
        assert mine.name == f.read().strip()
    assert mine.label.endswith("(this process: gpudash, jax)")
    assert rows[0].name == "trainer" and not rows[0].is_self and rows[0].framework is None
    lines = nvml.format_processes({0: rows})
    assert lines[0] == "    GPU 0: 3 process(es)"
    assert "2.00 GiB" in lines[1] and "compute+graphics" in lines[1]
    assert lines[3].split()[2] == "N/A"


def test_gpu_processes_failing_lists(use_fake):
    use_fake(FakeNVMLProcesses(broken={"nvmlDeviceGetComputeRunningProcesses",
                                       "nvmlDeviceGetGraphicsRunningProcesses"}))
    assert nvml.gpu_processes() == {0: [], 1: []}
    assert nvml.format_processes({0: []}) == ["    GPU 0: no processes"]


def test_gpu_processes_without_driver_is_empty(use_fake):
    use_fake(FakeNVML(init_error=12))
    assert nvml.gpu_processes() == {}
    assert nvml_available() == (False, "NVML library not found (no NVIDIA driver)")


@pytest.mark.skipif(CudaMemory.available()[0], reason="this machine has a GPU")
def test_real_nvml_processes_without_driver():
    assert nvml.gpu_processes() == {}


def test_gpudash_info_lists_processes(use_fake, capsys):
    from gpudash.cli import main

    use_fake(FakeNVMLProcesses())
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "GPU 0: 3 process(es)" in out
    assert "(this process: gpudash)" in out
    assert "trainer" in out


def test_nvml_index_of_uuid(use_fake):
    use_fake(FakeNVML())
    assert nvml.nvml_index_of_uuid("GPU-00000001") == 1
    assert nvml.nvml_index_of_uuid("00000001") == 1  # torch prints the bare form
    assert nvml.nvml_index_of_uuid("GPU-ffff") is None
