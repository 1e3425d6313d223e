"""Every test under tests/e2e is an e2e test (``-m "not e2e"`` selects the unit tests), whether or not
its module also says so."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from tests.e2e.loaders import Loader

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if str(item.path).startswith(HERE + os.sep):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture
def loaders() -> Iterator[Callable[..., Loader]]:
    """Starts :class:`tests.e2e.loaders.Loader` processes; kills those still running after the test."""
    started: list[Loader] = []

    def start(env: dict[str, str] | None = None, wrapper: tuple[str, ...] = ()) -> Loader:
        loader = Loader(env, wrapper)
        started.append(loader)
        return loader

    yield start
    for loader in started:
        if loader.process.poll() is None:
            loader.kill()
