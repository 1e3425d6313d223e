"""What CONTRIBUTING.md promises a contributor: the pre-commit hooks run what `make lint` and the drift
check run, with the development venv's own tools; `make fmt` exists; the license the packages declare is
the one the repository carries."""

from __future__ import annotations

import os
import re
import shlex

import yaml

from tests.conftest import REPO


def makefile() -> str:
    with open(os.path.join(REPO, "Makefile"), encoding="utf-8") as handle:
        return handle.read()


def hooks() -> dict[str, dict]:
    with open(os.path.join(REPO, ".pre-commit-config.yaml"), encoding="utf-8") as handle:
        config = yaml.safe_load(handle)
    (repo,) = config["repos"]
    assert repo["repo"] == "local"  # nothing fetched: the venv's versions, as make lint's
    return {hook["id"]: hook for hook in repo["hooks"]}


def test_each_hook_runs_a_command_of_make_lint_or_the_drift_check_from_the_venv() -> None:
    venv = re.search(r"^VENV := (\S+)$", makefile(), re.M).group(1)  # type: ignore[union-attr]
    make = makefile().replace("$(VENV)", venv).replace("$(PY)", f"{venv}/bin/python")
    for hook_id, hook in hooks().items():
        program, *args = shlex.split(hook["entry"])
        assert program.startswith(f"{venv}/bin/") and hook["language"] == "system", hook_id
        tool = f"{program} {' '.join(args)}".strip()
        assert tool in make or hook_id == "generated", (hook_id, tool)
    # the drift check CI runs (tests/e2e/test_deploy_rule_variants.py), on the development venv's Python
    assert hooks()["generated"]["entry"] == f"{venv}/bin/python -m deploy.generate --check"


def test_make_fmt_mends_with_the_linters_rules() -> None:
    target = re.search(r"^fmt: venv\n((?:\t.*\n)+)", makefile(), re.M)
    assert target is not None and "ruff check --fix $(LINTED)" in target.group(1)
    assert "ruff check $(LINTED)" in makefile()  # the same folders make lint checks


def test_the_license_is_the_one_the_packages_declare() -> None:
    with open(os.path.join(REPO, "LICENSE"), encoding="utf-8") as handle:
        text = handle.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    with open(os.path.join(REPO, "exporter", "instrument", "LICENSE"), encoding="utf-8") as handle:
        assert handle.read() == text  # the library's own distribution carries it too
    for pyproject in ("pyproject.toml", os.path.join("exporter", "instrument", "pyproject.toml")):
        with open(os.path.join(REPO, pyproject), encoding="utf-8") as handle:
            assert 'license = "Apache-2.0"' in handle.read(), pyproject
