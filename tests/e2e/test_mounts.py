"""The mounts gpuio names for engine files, as findmnt sees them."""

from __future__ import annotations

import shutil
import subprocess

import pytest

import gpuio
from exporter.exposition import render
from tests.conftest import engines_collector, parse_samples

pytestmark = pytest.mark.e2e


def test_every_engine_file_names_its_mount_as_findmnt_sees_it(tmp_path) -> None:
    """The engines collector on this machine's real /proc: a file a process loads and a file only a glob
    names both get gpuio_engine_mount_info, with the mount point and type util-linux's findmnt reports."""
    if shutil.which("findmnt") is None:
        pytest.skip("findmnt (util-linux) is not installed")
    spool, models = tmp_path / "spool", tmp_path / "models"
    spool.mkdir()
    models.mkdir()
    loaded, globbed = models / "loaded.engine", models / "globbed.plan"
    loaded.write_bytes(b"\0" * 4096)
    globbed.write_bytes(b"\0" * 4096)
    gpuio.close()
    gpuio.configure(str(spool))
    try:
        gpuio.load(str(loaded), bytes)
        target = engines_collector(str(spool), path=(str(models / "*.plan"),))
        target.collect()
        target.service.files.scanner.sample_now()
        samples = parse_samples(render(target.collect()))
    finally:
        gpuio.close()
        gpuio.configure(None)
    found = {dict(labels)["path"]: dict(labels) for (name, labels) in samples if name == "gpuio_engine_mount_info"}
    for path in (str(loaded), str(globbed)):
        target_fs = subprocess.run(["findmnt", "-n", "-o", "TARGET,FSTYPE", "-T", path], capture_output=True,
                                   text=True, check=True).stdout.split()
        assert (found[path]["mountpoint"], found[path]["fstype"]) == tuple(target_fs)
    mount = frozenset({("mountpoint", found[str(loaded)]["mountpoint"])})
    assert samples[("gpuio_mount_engine_loads_in_progress", mount)] == 0  # served at 0 when nothing loads
