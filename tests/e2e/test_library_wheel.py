"""gpuio, the instrumentation library, is its own distribution with no third-party dependency.

Its wheel is built from exporter/instrument/ with pip, installed into a fresh virtual environment
that holds nothing else, and imported there; docs/engines.md's complete example runs there as
written, and the exporter's spool reader finds what it recorded.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from exporter.engines.model import histogram_count_and_sum
from exporter.engines.spool import SpoolReader
from tests.conftest import LIBRARY, REPO, c_path_can_be_built

pytestmark = pytest.mark.e2e

DOCS = os.path.join(REPO, "docs", "engines.md")


def run(*command: str, cwd: str, env: dict[str, str] | None = None) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    source = out / "source"  # a copy: pip builds in the tree, and the checkout stays clean
    shutil.copytree(LIBRARY, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so"))
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(source), cwd=str(out))
    (built,) = glob.glob(str(out / "gpuio-*.whl"))
    return Path(built)


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory, wheel: Path) -> Path:
    """A fresh virtual environment (pip only) with the wheel installed from nowhere but the file."""
    venv = tmp_path_factory.mktemp("bare") / "venv"
    run(sys.executable, "-m", "venv", str(venv), cwd=str(venv.parent))
    run(str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "--quiet", str(wheel),
        cwd=str(venv.parent), env=clean_env())
    return venv


def clean_env() -> dict[str, str]:
    """No PYTHONPATH: the bare environment must find gpuio in itself, not in this checkout."""
    return {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "PYTHONHOME")}


def test_the_wheel_declares_no_dependency(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as archive:
        (metadata,) = [name for name in archive.namelist() if name.endswith(".dist-info/METADATA")]
        text = archive.read(metadata).decode()
        packages = {name.split("/")[0] for name in archive.namelist() if not name.split("/")[0].endswith("-info")}
    required = [line for line in text.splitlines() if line.startswith("Requires-Dist:")]
    assert all("extra ==" in line for line in required), required  # only the optional TensorRT extra
    assert packages == {"gpuio"}  # nothing of the exporter inside


def test_installing_it_pulls_in_no_third_party_package(bare: Path) -> None:
    listed = json.loads(run(str(bare / "bin" / "python"), "-m", "pip", "list", "--format=json",
                            cwd=str(bare.parent), env=clean_env()))
    assert {package["name"] for package in listed} - {"pip", "setuptools"} == {"gpuio"}


def test_it_imports_there_with_the_standard_library_only(bare: Path) -> None:
    code = ("import sys, json, gpuio; print(json.dumps([gpuio.__file__, "
            "sorted({m.split('.')[0] for m in sys.modules} - set(sys.stdlib_module_names))]))")
    where, outside = json.loads(run(str(bare / "bin" / "python"), "-c", code, cwd=str(bare.parent), env=clean_env()))
    assert where.startswith(str(bare))  # the installed copy, not this checkout's
    # __main__ is the -c script; _distutils_hack is setuptools' start-up shim, present in any venv.
    assert set(outside) - {"__main__", "_distutils_hack"} == {"gpuio"}


def test_the_c_hot_path_is_built_into_the_wheel_where_it_can_be(wheel: Path, bare: Path) -> None:
    """pip compiles gpuio/_hotpath.c where there is a C compiler and CPython >= 3.11's headers, as one
    abi3 file, and the installed library uses it; where it cannot, the build still succeeds and the
    library stores in Python."""
    with zipfile.ZipFile(wheel) as archive:
        built = [name for name in archive.namelist() if name.startswith("gpuio/_hotpath") and name.endswith(".so")]
    hot_path = run(str(bare / "bin" / "python"), "-c", "import gpuio; print(gpuio.describe()['hot_path'])",
                   cwd=str(bare.parent), env=clean_env()).strip()
    if c_path_can_be_built():
        assert built == ["gpuio/_hotpath.abi3.so"] and "-cp311-abi3-" in wheel.name
        assert hot_path == "c"
    else:
        assert built == [] and hot_path in ("python", "locked")


def test_without_a_c_compiler_the_wheel_is_pure_python_and_works(tmp_path: Path) -> None:
    """A slim image has no compiler: pip still builds gpuio (the C file is optional), the wheel says it
    is pure Python (py3-none-any), and the library stores in Python."""
    source = tmp_path / "source"
    shutil.copytree(LIBRARY, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so"))
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(source),
        cwd=str(tmp_path), env={**os.environ, "CC": str(tmp_path / "no-such-compiler")})
    (built,) = glob.glob(str(tmp_path / "gpuio-*.whl"))
    assert built.endswith("-py3-none-any.whl")
    with zipfile.ZipFile(built) as archive:
        assert not [name for name in archive.namelist() if name.endswith(".so")]
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", str(venv), cwd=str(tmp_path))
    run(str(venv / "bin" / "python"), "-m", "pip", "install", "--no-index", "--quiet", built, cwd=str(tmp_path),
        env=clean_env())
    code = ("import gpuio; gpuio.configure('-'); e = gpuio.engine('e'); e.inference_seconds.observe(0.5)\n"
            "with e.infer(): pass\nprint(gpuio.describe()['hot_path'], e.inference_seconds.count())")
    output = run(str(venv / "bin" / "python"), "-c", code, cwd=str(tmp_path), env=clean_env())
    assert output.split() == ["python", "2.0"]


def test_the_pure_python_wheel_is_the_one_for_python_3_10_and_aarch64(tmp_path: Path) -> None:
    """`make dist` builds a pure-Python wheel beside the C one (GPUIO_PURE_PYTHON=1, a compiler present): the
    C wheel's tag fits no CPython 3.10 and no aarch64 machine, the pure one's fits every Python >= 3.10 the
    library claims, on x86_64 and aarch64 alike, and it carries no compiled file."""
    from packaging import tags
    from packaging.utils import parse_wheel_filename

    source = tmp_path / "source"
    shutil.copytree(LIBRARY, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "*.so"))
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(source),
        cwd=str(tmp_path), env={**os.environ, "GPUIO_PURE_PYTHON": "1"})
    (built,) = glob.glob(str(tmp_path / "gpuio-*.whl"))
    with zipfile.ZipFile(built) as archive:
        assert not [name for name in archive.namelist() if name.endswith((".so", ".pyd"))]
        metadata = archive.read(next(name for name in archive.namelist() if name.endswith("METADATA"))).decode()
    assert "Requires-Python: >=3.10" in metadata
    _, _, _, pure_tags = parse_wheel_filename(os.path.basename(built))
    c_tags = parse_wheel_filename("gpuio-1.0-cp311-abi3-linux_x86_64.whl")[3]
    for python in ((3, 10), (3, 11), (3, 12), (3, 13)):
        for platform in ("manylinux_2_17_x86_64", "manylinux_2_17_aarch64", "linux_aarch64"):
            supported = set(tags.cpython_tags(python, platforms=[platform])) | set(
                tags.compatible_tags(python, platforms=[platform]))
            assert pure_tags & supported, (python, platform)
            if python == (3, 10) or "aarch64" in platform:
                assert not c_tags & supported, (python, platform)


def documented_example() -> str:
    """The python block of docs/engines.md's installation section, as written there."""
    with open(DOCS, encoding="utf-8") as file:
        text = file.read()
    section = text.split("## Installing the library into an inference image", 1)[1].split("\n## ", 1)[0]
    assert "pip install ./exporter/instrument" in section
    (example,) = re.findall(r"```python\n(.*?)```", section, re.S)
    return example


def test_the_documented_example_runs_as_written(bare: Path, tmp_path: Path) -> None:
    script = tmp_path / "example.py"
    script.write_text(documented_example())
    spool = tmp_path / "spool"
    spool.mkdir()
    output = run(str(bare / "bin" / "python"), str(script), cwd=str(tmp_path),
                 env={**clean_env(), "GPUIO_SPOOL_DIR": str(spool)})
    assert output.strip() == f"engine detector spool {spool}"
    totals = SpoolReader(str(spool)).read()
    assert histogram_count_and_sum(totals.engines["detector"], "load_read_seconds")[0] == 1
    assert histogram_count_and_sum(totals.engines["detector"], "inference_seconds")[0] == 2
    assert totals.last_load["detector"] > 0  # the writer exited: folded, its last load kept


def test_the_exporter_distribution_depends_on_it_and_does_not_ship_it(tmp_path: Path) -> None:
    source = tmp_path / "source"
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "tests", "bench"))
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(tmp_path), str(source),
        cwd=str(tmp_path))
    (built,) = glob.glob(str(tmp_path / "gpuio_exporter-*.whl"))
    with zipfile.ZipFile(built) as archive:
        names = archive.namelist()
        (metadata,) = [name for name in names if name.endswith(".dist-info/METADATA")]
        required = [line for line in archive.read(metadata).decode().splitlines() if line.startswith("Requires-Dist:")]
    assert "Requires-Dist: gpuio==0.1.0" in required
    assert [name for name in names if "gpuio/" in name or name.startswith("exporter/instrument")] == []
