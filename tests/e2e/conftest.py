"""Every test under tests/e2e is an e2e test (``-m "not e2e"`` selects the unit tests), whether or not
its module also says so."""

from __future__ import annotations

import os

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if str(item.path).startswith(HERE + os.sep):
            item.add_marker(pytest.mark.e2e)
