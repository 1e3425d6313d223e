"""Both distributions built as users get them, and installed from the built files, not the tree.

``make dist``'s commands (``python -m build`` on exporter/instrument, then on the repository) run on a
copy of the tracked files, so the checkout stays clean; the exporter's wheel is installed with pipx into a
home of this test's own (its dependencies from the package index, gpuio from the built files: the
exporter pins that very version), and the installed commands run from outside the repository.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tarfile
import time
import urllib.request
import zipfile
from pathlib import Path

import pytest

from tests.conftest import REPO, free_port

pytestmark = pytest.mark.e2e

VERSION = Path(REPO, "exporter", "instrument", "gpuio", "VERSION").read_text().strip()


def run(*command: str, cwd: str, env: dict[str, str] | None = None, timeout: int = 600) -> str:
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if shutil.which("git") is None:
        pytest.skip("git is not installed (the tracked files are copied)")
    pytest.importorskip("build", reason="pip install build (dev extras)")
    source = tmp_path_factory.mktemp("source")
    for name in run("git", "ls-files", "-z", cwd=REPO).split("\0"):
        if name and os.path.isfile(os.path.join(REPO, name)):
            os.makedirs(source / os.path.dirname(name), exist_ok=True)
            shutil.copy2(os.path.join(REPO, name), source / name)
    out = tmp_path_factory.mktemp("dist")
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), "exporter/instrument", cwd=str(source))
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), ".", cwd=str(source))
    return out


def test_make_dist_builds_both_distributions_as_sdist_and_wheel_at_one_version(dist: Path) -> None:
    names = sorted(os.path.basename(path) for path in glob.glob(str(dist / "*")))
    assert [name for name in names if name.endswith(".tar.gz")] == [f"gpuio-{VERSION}.tar.gz",
                                                                    f"gpuio_exporter-{VERSION}.tar.gz"]
    wheels = [name for name in names if name.endswith(".whl")]
    assert len(wheels) == 2 and all(f"-{VERSION}-" in name for name in wheels), names
    (exporter_wheel,) = glob.glob(str(dist / "gpuio_exporter-*.whl"))
    with zipfile.ZipFile(exporter_wheel) as wheel:
        files = wheel.namelist()
        metadata = wheel.read(f"gpuio_exporter-{VERSION}.dist-info/METADATA").decode()
    assert "gpuio_exporter/engines/discovery.py" in files and not any("instrument" in name for name in files)
    assert not [name for name in files if name.startswith("exporter/")]  # an import name of its own
    # the generators and what they read (gpuio generate), under the exporter's name: no top-level deploy
    shipped = ("generate.py", "grafana/boards/starvation.py", "prometheus/runbooks/MountIOStorm.md",
               "kubernetes/daemonset.yaml", "kubernetes/components/smart/kustomization.yaml",
               "victoriametrics/vmalert.py", "victoriametrics/scrape.yml")
    assert {f"gpuio_exporter/deploy/{name}" for name in shipped} <= set(files)
    assert not [name for name in files if name.startswith("deploy/") or "/local/" in name]
    assert f"gpuio_exporter-{VERSION}.dist-info/licenses/LICENSE" in files
    assert f"Requires-Dist: gpuio=={VERSION}" in metadata
    with tarfile.open(dist / f"gpuio_exporter-{VERSION}.tar.gz") as sdist:  # the sdist builds its wheel alone
        assert f"gpuio_exporter-{VERSION}/exporter/instrument/gpuio/VERSION" in sdist.getnames()


def generated_outside_the_repository(gpuio: str, out: Path, env: dict[str, str]) -> None:
    """``gpuio generate`` of the install, run from /: your threshold in the rules promtool accepts (both disk
    sources), the boards, the runbooks and the Kubernetes objects, each file what the checkout writes."""
    from deploy import generate as generator

    args = ["--set", "IO_PRESSURE_FULL=0.2", "--image", "registry.example/gpuio-exporter:1", "--component", "smart",
            "--vmalert-shards", "2"]
    run(gpuio, "generate", *args, "--out", str(out), cwd="/", env=env)
    written = {str(path.relative_to(out)): path.read_text() for path in out.rglob("*") if path.is_file()}
    checkout = out.parent / "checkout"
    assert generator.main([*args, "--out", str(checkout)], environ={}) == 0
    expected = {str(path.relative_to(checkout)): path.read_text() for path in checkout.rglob("*") if path.is_file()}
    assert written.keys() == expected.keys()
    differ = [name for name in written if written[name] != expected[name].replace(str(checkout), str(out))]
    assert differ == [], differ
    promtool = shutil.which("promtool")
    if promtool:
        rule_files = sorted(str(out / name) for name in written
                            if name.endswith(".yml") and not name.startswith(("kubernetes", "vmalert", "cells")))
        assert len(rule_files) == 10, rule_files  # five files, for each disk source
        run(promtool, "check", "rules", *rule_files, cwd="/")
    assert "stalled_seconds:rate1m >= 0.2" in written["starvation.yml"]
    assert "stalled_seconds:rate1m >= 0.2" in written["rules-node-exporter/starvation.yml"]
    # vmalert's copies, one a shard, and the scrape that labels the shards
    assert "stalled_seconds:rate1m >= 0.2" in written["vmalert/shard-1/starvation.yml"]
    assert "'{shard=\"1\"}'" in written["vmalert/shard-1/starvation.yml"]
    assert "modulus: 2" in written["vmalert/scrape.yml"]
    assert "gpuio_gpu_time_seconds_total|" in written["cells/fleet-keep.yml"]  # a cell forwards the Fleet board's
    assert "20% full" in written["dashboards/gpuio-disk-io.json"]
    assert '20 % ("full")' in written["runbooks/MountIOStorm.md"]
    assert "newName: registry.example/gpuio-exporter" in written["kubernetes/kustomization.yaml"]


def test_pipx_installs_the_exporter_from_the_built_files_and_it_serves(dist: Path, tmp_path: Path) -> None:
    pipx = shutil.which("pipx") or os.path.join(os.path.dirname(sys.executable), "pipx")
    if not os.access(pipx, os.X_OK):
        pytest.skip("pipx is not installed (dev extras)")
    env = {key: value for key, value in os.environ.items() if key not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(PIPX_HOME=str(tmp_path / "pipx"), PIPX_BIN_DIR=str(tmp_path / "bin"), PIPX_MAN_DIR=str(tmp_path / "man"))
    (wheel,) = glob.glob(str(dist / "gpuio_exporter-*.whl"))
    run(pipx, "install", "--python", sys.executable, "--pip-args", f"--find-links {dist}", wheel, cwd=str(tmp_path),
        env=env, timeout=900)
    exporter = str(tmp_path / "bin" / "gpuio-exporter")
    assert run(exporter, "--version", cwd="/", env=env).strip() == f"gpuio-exporter {VERSION}"
    where = run(str(tmp_path / "pipx" / "venvs" / "gpuio-exporter" / "bin" / "python"), "-c",
                "import gpuio_exporter, gpuio; print(gpuio_exporter.__file__); print(gpuio.__file__)", cwd="/", env=env)
    assert all(str(tmp_path) in line and REPO not in line for line in where.splitlines()), where
    assert "usage: gpuio engines" in run(str(tmp_path / "bin" / "gpuio"), "engines", "--help", cwd="/", env=env)
    generated_outside_the_repository(str(tmp_path / "bin" / "gpuio"), tmp_path / "site", env)
    port = free_port()
    server = subprocess.Popen([exporter, f"--web.listen-address=127.0.0.1:{port}", "--collector.disable-defaults",
                               "--collector.pressure"], cwd="/", env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    text = response.read().decode()
                break
            except OSError:
                alive = time.monotonic() < deadline and server.poll() is None
                assert alive, server.stderr.read() if server.stderr else ""
                time.sleep(0.3)
        assert f'version="{VERSION}"' in text
    finally:
        server.terminate()
        server.wait(timeout=10)
