"""A collector, the option parsers, the scraper's assembly and the catalogue of families load without the web stack.

Each module is imported in a fresh interpreter (this process has long loaded everything), and the
modules it pulled in are read from sys.modules: FastAPI, uvicorn, bcrypt and YAML belong to the
HTTP server only, so a GPU machine or an inference image without them can still collect.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.e2e

WEB_STACK = ("fastapi", "uvicorn", "starlette", "pydantic", "bcrypt", "yaml")
LIGHT = [
    "exporter.options",
    "exporter.collect",
    "exporter.collectors",
    *(f"exporter.collectors.{name[:-3]}" for name in sorted(os.listdir(os.path.join(REPO, "exporter", "collectors")))
      if name.endswith(".py") and name != "__init__.py"),
    "exporter.assemble",
    "exporter.web.server_metrics",  # the server's families, declared below the web stack
    "exporter.catalogue",  # every family: what gpuio top, the rules and the dashboards read names from
]


def loaded_by(module: str) -> set[str]:
    code = f"import sys, json, {module}; print(json.dumps(sorted(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60,
                            check=True)
    return set(json.loads(result.stdout))


@pytest.mark.parametrize("module", LIGHT)
def test_importing_it_loads_no_part_of_the_web_stack(module: str) -> None:
    loaded = loaded_by(module)
    assert module in loaded
    assert {name for name in loaded if name.split(".")[0] in WEB_STACK} == set()


def test_the_server_does_load_it() -> None:  # the check above can see the web stack
    assert "uvicorn" in loaded_by("exporter.web.server")


def test_the_server_without_a_web_config_or_gpus_loads_no_yaml_bcrypt_or_nvml_bindings() -> None:
    """PyYAML and bcrypt come with the first web configuration file, NVIDIA's bindings with the nvml
    collector's first start (together ~6 MiB of RSS an exporter without them does not pay)."""
    loaded = loaded_by("exporter.cli, exporter.web.server, exporter.web.webconfig, exporter.collectors")
    assert {name for name in loaded if name.split(".")[0] in ("yaml", "bcrypt", "pynvml")} == set()
