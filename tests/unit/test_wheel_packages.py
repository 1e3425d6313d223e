"""pyproject.toml lists the exporter's packages by hand (exporter/ installs as gpuio_exporter and deploy/
as gpuio_exporter.deploy, which ``packages.find`` cannot see): the list must name every package folder a
user's install needs, and only those, or a new module would be missing from the wheel while every test in
the checkout passes."""

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


def folder_of(package: str, mapping: dict[str, str]) -> str:
    """The folder setuptools takes ``package`` from: the longest mapped prefix's folder, then the rest."""
    heads = [name for name in mapping if package == name or package.startswith(name + ".")]
    head = max(heads, key=len)  # every package is under a mapped name: nothing installs as `exporter`
    return os.path.join(mapping[head], *package[len(head):].split(".")[1:])


def test_the_listed_packages_are_the_package_folders_under_the_exporters_own_name() -> None:
    table = setuptools_table()
    mapping = table["package-dir"]
    assert mapping == {"gpuio_exporter": "exporter", "gpuio_exporter.deploy": "deploy"}
    assert all(package.split(".")[0] == "gpuio_exporter" for package in table["packages"])
    listed = {folder_of(package, mapping) for package in table["packages"]}
    assert listed == package_folders("exporter") | package_folders("deploy")


def test_the_console_scripts_are_the_installed_names() -> None:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        scripts = tomllib.load(handle)["project"]["scripts"]
    assert scripts == {"gpuio-exporter": "gpuio_exporter.cli:exporter_main", "gpuio": "gpuio_exporter.cli:tools_main"}


def test_the_package_data_the_generators_read_exists() -> None:
    data = setuptools_table()["package-data"]
    for package, patterns in data.items():
        folder = os.path.join(REPO, folder_of(package, setuptools_table()["package-dir"]))
        for pattern in patterns:
            assert glob.glob(os.path.join(folder, pattern)), (package, pattern)
