"""requirements-run.txt, what `make run` installs with ``pip install --no-deps``, says what pyproject.toml
says: every runtime dependency pinned inside its range, nothing of the development extras, and every
dependency of a pinned package pinned too (checked against the metadata of the same versions where this
environment has them; `make run` also runs ``pip check`` on what it installed)."""

from __future__ import annotations

import importlib.metadata
import os
import sys

import pytest

from tests.conftest import REPO

tomllib = pytest.importorskip("tomllib") if sys.version_info >= (3, 11) else pytest.importorskip("tomli")
requirements = pytest.importorskip("packaging.requirements")
utils = pytest.importorskip("packaging.utils")

LOCK = os.path.join(REPO, "requirements-run.txt")
# Built from this repository (exporter/instrument/), not taken from an index: `make run` puts its folder
# on the runtime venv's path beside the exporter's.
FROM_THIS_REPOSITORY = {"gpuio"}


def project() -> dict:
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as handle:
        return tomllib.load(handle)["project"]


def locked() -> dict[str, requirements.Requirement]:
    out = {}
    with open(LOCK) as handle:
        for line in handle:
            line = line.split("#", 1)[0].strip()
            if line:
                requirement = requirements.Requirement(line)
                out[utils.canonicalize_name(requirement.name)] = requirement
    return out


def pinned_version(requirement: requirements.Requirement) -> str:
    (spec,) = requirement.specifier
    assert spec.operator == "==", f"{requirement} is not pinned with =="
    return spec.version


def applies(requirement: requirements.Requirement, extra: str = "") -> bool:
    return requirement.marker is None or requirement.marker.evaluate({"extra": extra})


def test_every_runtime_dependency_is_pinned_inside_its_range() -> None:
    lock = locked()
    for text in project()["dependencies"]:
        wanted = requirements.Requirement(text)
        if not applies(wanted):
            continue
        assert not wanted.extras, f"{text}: extras are not in the lock; name the packages they bring"
        name = utils.canonicalize_name(wanted.name)
        if name in FROM_THIS_REPOSITORY:
            continue
        assert name in lock, f"{text} is not in requirements-run.txt"
        assert wanted.specifier.contains(pinned_version(lock[name]), prereleases=True), (text, str(lock[name]))


def test_nothing_of_the_development_extras() -> None:
    runtime = {utils.canonicalize_name(requirements.Requirement(t).name) for t in project()["dependencies"]}
    for extra, texts in project()["optional-dependencies"].items():
        for text in texts:
            name = utils.canonicalize_name(requirements.Requirement(text).name)
            assert name in runtime or name not in locked(), f"{name} (extra {extra}) is in the runtime lock"


def test_every_dependency_of_a_pinned_package_is_pinned() -> None:
    lock = locked()
    checked = 0
    for name, requirement in lock.items():
        if not applies(requirement):
            continue
        try:
            distribution = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        if distribution.version != pinned_version(requirement):
            continue  # another version here: its metadata says nothing about the pinned one
        checked += 1
        for text in distribution.requires or []:
            needed = requirements.Requirement(text)
            if not applies(needed):
                continue  # an extra's dependency, or another Python's
            dependency = utils.canonicalize_name(needed.name)
            assert dependency in lock, f"{name}=={distribution.version} needs {text}, not in requirements-run.txt"
            assert needed.specifier.contains(pinned_version(lock[dependency]), prereleases=True), (name, text)
    assert checked >= len(lock) // 2, "too few pinned versions installed here to check the lock's closure"
