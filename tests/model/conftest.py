"""Fixtures of the model tests."""

from __future__ import annotations

import pytest

from runtime.model import kernels


@pytest.fixture
def ops(monkeypatch):
    """pie-ctx's built CPU kernels (runtime.model.kernels), on; the test skips where they
    did not build (the eager code runs there)."""
    monkeypatch.setattr(kernels, "ENABLED", True)
    built = kernels.ops()
    if built is None:
        pytest.skip("the CPU kernels did not build here (no compiler?); the eager code runs")
    return built
