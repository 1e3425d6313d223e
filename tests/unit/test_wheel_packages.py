"""pyproject.toml lists the exporter's packages by hand (deploy/ is mapped to exporter.deploy, which
``packages.find`` cannot see): the list must name every package folder a user's install needs, and only
those, or a new module would be missing from the wheel while every test in the checkout passes."""

from __future__ import annotations

import glob
import os
import sys

import pytest

from tests.conftest import REPO

tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")

# Not installed: the instrumentation library (its own distribution) and the local stack (make stack).
NOT_SHIPPED = {os.path.join("exporter", "instrument"), os.path.join("deploy", "local")}


def setuptools_table() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)["tool"]["setuptools"]


def package_folders(top: str) -> set[str]:
    out = set()
    for root, dirs, files in os.walk(os.path.join(REPO, top)):
        relative = os.path.relpath(root, REPO)
        if any(relative == skip or relative.startswith(skip + os.sep) for skip in NOT_SHIPPED):
            dirs.clear()
            continue
        if "__init__.py" in files:
            out.add(relative)
    return out


def test_the_listed_packages_are_the_package_folders() -> None:
    table = setuptools_table()
    mapping = table["package-dir"]
    assert mapping == {"exporter.deploy": "deploy"}
    listed = set()
    for package in table["packages"]:
        head = next((name for name in mapping if package == name or package.startswith(name + ".")), None)
        inside = package if head is None else package[len(head):]
        folder = (mapping[head] if head else "") + inside.replace(".", os.sep)
        listed.add(folder)
    assert listed == package_folders("exporter") | package_folders("deploy")


def test_the_package_data_the_generators_read_exists() -> None:
    data = setuptools_table()["package-data"]
    for package, patterns in data.items():
        folder = os.path.join(REPO, "deploy", *package.split(".")[2:])
        for pattern in patterns:
            assert glob.glob(os.path.join(folder, pattern)), (package, pattern)
