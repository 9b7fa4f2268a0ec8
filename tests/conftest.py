"""Shared test configuration: tests marked ``gpu`` skip cleanly without a CUDA device."""

from __future__ import annotations

import pytest


def _cuda() -> tuple[bool, str]:
    from gpudash.devices import CudaMemory

    return CudaMemory.available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    ok, reason = _cuda()
    if ok:
        return
    skip = pytest.mark.skip(reason=f"needs a CUDA device: {reason}")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
