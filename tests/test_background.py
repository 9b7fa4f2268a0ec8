"""run_in_background: results, exceptions, cancellation, status widget."""

from __future__ import annotations

import threading
import time

import pytest

import gpudash
from gpudash.background import BackgroundTask, CancelledError, run_in_background


def test_result_and_state():
    gate = threading.Event()

    def work(a, b=0):
        gate.wait(10)
        return a + b

    task = run_in_background(work, 2, b=3, name="adder")
    assert isinstance(task, BackgroundTask)
    assert not task.done and task.running
    assert "adder" in repr(task) and "running" in repr(task)
    with pytest.raises(TimeoutError):
        task.result(timeout=0.01)
    gate.set()
    assert task.result(timeout=10) == 5
    assert task.done and not task.running
    assert task.exception() is None
    assert task.join(1)
    assert task.elapsed > 0
    assert task.status() == "done"
    assert task._thread.daemon


def test_exception_propagates():
    def fail():
        raise gpudash.ConfigError("bad value")

    task = run_in_background(fail)
    assert task.join(10)
    with pytest.raises(gpudash.ConfigError, match="bad value"):
        task.result()
    assert isinstance(task.exception(), gpudash.ConfigError)
    assert task.status() == "failed"
    assert "ConfigError" in task.format_exception()


def test_cancel_sets_the_stop_event():
    started = threading.Event()

    def loop(stop_event):
        started.set()
        n = 0
        while not stop_event.is_set():
            n += 1
            time.sleep(0.001)
        return n

    task = run_in_background(loop)
    assert started.wait(10)
    task.cancel()
    assert task.cancelled
    assert task.result(timeout=10) >= 1
    assert task.status() == "cancelled"


def test_stop_event_only_given_to_functions_that_take_it():
    task = run_in_background(lambda **kw: sorted(kw), x=1)
    assert task.result(timeout=10) == ["x"]


def test_cancel_before_start_raises_cancelled():
    task = BackgroundTask(lambda: 1, (), {})
    task.cancel()
    task._start()
    with pytest.raises(CancelledError):
        task.result(timeout=10)


@pytest.mark.core
def test_controls_stay_usable_while_a_workload_runs():
    """The point of it: a workload in the background, the session reconfigured meanwhile."""
    with gpudash.Session(simulate="16GiB", poll=False) as sess:
        def workload(stop_event):
            n = 0
            while not stop_event.is_set():
                sess.free_now(sess.allocate(1 << 20))
                n += 1
            return n

        task = run_in_background(workload)
        sess.configure(per_process_gpu_memory_fraction=0.25)
        assert sess.devices[0].memory_limit == 4 << 30
        time.sleep(0.05)
        task.cancel()
        assert task.result(timeout=10) > 0


def test_status_widget():
    gate = threading.Event()
    task = run_in_background(lambda stop_event: gate.wait(10) and 1, name="job")
    w = task.widget()
    button, label = w.children
    assert "job: running" in label.value and not button.disabled
    button.click()
    assert task.cancelled and button.disabled
    gate.set()
    task.join(10)
    assert task.widget() is w
    assert "job:" in label.value and "running" not in label.value


def test_not_callable():
    with pytest.raises(TypeError):
        run_in_background(42)
