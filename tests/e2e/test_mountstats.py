"""mountstats against node_exporter's, and a non-root exporter on the real /proc."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
import urllib.request

import pytest

from tests.conftest import LIBRARY, REPO, Samples, free_port, parse_samples
from tests.unit.test_mountstats import KUBELET_POINT, collect, fixture, procfs_with

pytestmark = pytest.mark.e2e

NODE_EXPORTER = shutil.which("prometheus-node-exporter") or shutil.which("node_exporter")


def _scrape_node_exporter(procfs: str) -> Samples:
    port = free_port()
    process = subprocess.Popen([NODE_EXPORTER, "--collector.disable-defaults", "--collector.mountstats",
                                f"--path.procfs={procfs}", f"--web.listen-address=127.0.0.1:{port}"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
                    return parse_samples(response.read().decode())
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        process.terminate()
        process.wait(10)


@pytest.mark.parametrize("name", ["kubelet-nfs4", "procfs-26231"])
def test_every_node_exporter_series_has_an_equal_gpuio_twin(tmp_path, name: str) -> None:
    if NODE_EXPORTER is None:
        pytest.skip("prometheus-node-exporter is not installed")
    info = fixture("procfs-26231.mountinfo") if name == "procfs-26231" else ""
    procfs = procfs_with(tmp_path, fixture(f"{name}.mountstats"), info)
    theirs = _scrape_node_exporter(procfs)
    ours = collect(procfs, **{"max-operations": 1000})
    compared = 0
    for (metric, labels), value in theirs.items():
        if not metric.startswith("node_mountstats_nfs_") or metric.endswith("_mountpoint_info"):
            continue
        twin = dict(labels)
        if twin.get("operation") and theirs.get(("node_mountstats_nfs_operations_requests_total", frozenset(
                {k: v for k, v in twin.items()}.items()))) == 0:
            continue  # operations never used: gpuio leaves them out
        twin["mountpoint"] = "/mnt/nfs/test" if name == "procfs-26231" else KUBELET_POINT
        ours_name = "gpuio_" + metric.removeprefix("node_")
        if "_transport_" in metric and "transport" not in twin:
            twin["transport"] = "0"  # node_exporter before 1.6 had one transport and no label for it
        assert ours[(ours_name, frozenset(twin.items()))] == value, (metric, labels)
        compared += 1
    assert compared > 60


def test_a_non_root_exporter_falls_back_to_its_own_mountstats_on_the_real_proc() -> None:
    """/proc/1/mountstats is mode 0400: as nobody the collector reads init's mountinfo (world-readable)
    and, where an NFS mount is listed, its own mountstats; it says so, and does not fail."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv (util-linux) to switch to nobody")
    code = (f"import sys; sys.path[:0] = [{REPO!r}, {LIBRARY!r}]; from exporter.context import Context; "
            "from exporter.collectors.mountstats import MountstatsCollector; from exporter.exposition import render; "
            "print(render(MountstatsCollector(Context(), {}).collect()))")
    # setpriv, as tests/e2e/test_privilege.py does: runuser goes through PAM and a login shell's lookup of
    # the interpreter, which a root-only home directory (pyenv under /root) refuses to nobody.
    result = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
                            capture_output=True, text=True, timeout=60, env={"PATH": os.environ.get("PATH", "")})
    assert result.returncode == 0, result.stderr
    source = [dict(labels) for (name, labels) in parse_samples(result.stdout) if name == "gpuio_mountstats_source_info"]
    with open("/proc/1/mountinfo") as handle:
        nfs = any(" - nfs" in line for line in handle)
    # mountstats is read only where the table lists an NFS mount; then init's (0400) is refused to nobody.
    assert source == [{"mountinfo": "1", "mountstats": "self" if nfs else ""}]
