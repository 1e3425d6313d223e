"""The nvml collector on a real NVIDIA GPU, through pytest (marker ``gpu``; skipped without a GPU).

The checks and their tolerances live in tests/gpu/gpu_checks.py, which also runs without pytest
(``python tests/gpu/run_gpu_checks.py``) on GPU machines that have no pytest.
"""

from __future__ import annotations

import pytest

from tests.gpu import gpu_checks

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def _needs_a_gpu() -> None:
    reason = gpu_checks.unavailable()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.parametrize("check", gpu_checks.CHECKS, ids=[check.name for check in gpu_checks.CHECKS])
def test_on_the_gpu(check: gpu_checks.Check) -> None:
    for line in check.run():
        print(line)
