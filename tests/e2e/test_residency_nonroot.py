"""Residency without root, as the deployments run: the inference process and the exporter both as uid
65532, the model file root-owned 0644 (what an image or a root-run download leaves).

The kernel refuses cachestat(2) to both (EPERM) and mincore(2) would say every page is resident.  The
writer samples its own file with preadv2(RWF_NOWAIT) when its load starts and records the figure; the
exporter's own scan reports "permission" and serves the writer's figure with source="loader"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from tests.conftest import LIBRARY, REPO

UID = 65532

SCRIPT = r"""
import json, os, sys
import gpuio
from gpuio import waterfall as wf
from tests.conftest import engines_collector

model, spool = sys.argv[1], sys.argv[2]
gpuio.configure(spool_dir=spool)
fd = os.open(model, os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # any reader may drop clean pages
try:
    wf.cachestat_bytes(fd, os.fstat(fd).st_size)
    cachestat = "allowed"
except OSError as exc:
    cachestat = exc.strerror
os.close(fd)
cold = gpuio.load(model, bytes, name="nonroot").waterfall
warm = gpuio.load(model, bytes, name="nonroot").waterfall
collector = engines_collector(spool, path_include=(os.path.dirname(model),))
collector.collect()
collector.engine_files_now()
text = "".join(line for family in collector.collect() for line in family.samples)
print(json.dumps({"uid": os.getuid(), "cachestat": cachestat,
                  "cold": [cold.load_class, cold.cached_start.method, cold.cached_start.cached_bytes],
                  "warm": [warm.load_class, warm.cached_start.method, warm.cached_start.cached_bytes],
                  "metrics": [line for line in text.splitlines() if "cached" in line or "unavailable" in line]}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="needs root to drop to uid 65532")
def test_writer_residency_reaches_a_non_root_exporter() -> None:
    directory = tempfile.mkdtemp(dir="/var/tmp")
    os.chmod(directory, 0o755)
    model = os.path.join(directory, "model.plan")
    with open(model, "wb") as handle:
        handle.write(os.urandom(16 << 20))
    os.chmod(model, 0o644)
    os.sync()
    spool = tempfile.mkdtemp()
    os.chmod(spool, 0o777)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{REPO}:{LIBRARY}", "HOME": "/tmp"}
    done = subprocess.run(["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups", sys.executable, "-c",
                           SCRIPT, model, spool], capture_output=True, text=True, timeout=120, env=env, cwd=REPO)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    size = 16 << 20
    assert result["uid"] == UID and result["cachestat"] == "Operation not permitted"
    assert result["cold"][:2] == ["cold", "probe"] and result["cold"][2] <= 0.1 * size
    assert result["warm"] == ["warm", "probe", size]
    metrics = "\n".join(result["metrics"])
    assert 'gpuio_engine_file_residency_unavailable{reason="permission"} 1' in metrics
    assert f'gpuio_engine_file_cached_bytes{{engine="nonroot",path="{model}"}} {size}' in metrics
    assert f'gpuio_engine_file_cached_measured_timestamp_seconds{{engine="nonroot",path="{model}",source="loader"}}' \
        in metrics
