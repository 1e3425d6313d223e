"""Registers the `gpu` marker here too, so tests/gpu runs cleanly before pyproject.toml lists it."""

import pytest


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU and driver (skipped where there is none)")
