"""Names in bytes that are not UTF-8, chosen by a tenant, through every collector of a real exporter.

Linux names files, mount points and cgroups in bytes.  A process on a GPU that opened ``bad\\xff.plan``
once made /metrics and /api/v1/engines answer 500 for every collector, and kept them so after it exited
(the engine's history kept the name).  Here real processes hold real files under such names, on a real
tmpfs mounted at such a name, in a real blkio cgroup of such a name; the exporter's NVML is the fake
(tests/e2e/fake_gpu_exporter.py, no GPU here) listing the process on its GPU.  Every answer must stay
200, valid UTF-8 and valid for promtool, and show each odd byte as ``\\xNN``.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gpuio
from tests.conftest import REPO, ExporterProcess, parse_samples

pytestmark = pytest.mark.e2e

GPUIO = "from exporter.cli import tools_main; tools_main()"  # the `gpuio` console script

UUID = "GPU-0dd0b17e-0000-0000-0000-000000000001"
BAD = b"bad\xff\xfe"  # not UTF-8 in any position
SHOWN = "bad\\xff\\xfe"  # how a label or a JSON string shows it

# Opens the model named in hex, reads 1 MiB of it, says so, then holds it (as a server does).
HOLDER = ("import os, sys, time\n"
          "handle = open(os.fsdecode(bytes.fromhex(sys.argv[1])), 'rb', buffering=0)\n"
          "handle.read(1 << 20)\n"
          "print('ok', flush=True)\n"
          "time.sleep(120)\n")


def _model(directory: bytes, size: int = 2 << 20) -> bytes:
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, BAD + b".plan")
    with open(path, "wb") as handle:
        handle.write(os.urandom(size))
    return path


def _hold(path: bytes) -> subprocess.Popen:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, path.hex()], stdout=subprocess.PIPE, text=True)
    assert holder.stdout is not None and holder.stdout.readline().strip() == "ok"
    return holder


def _get(exporter: ExporterProcess, path: str) -> bytes:
    status, headers, body = exporter.get(path, {"Accept-Encoding": "gzip"})
    body = gzip.decompress(body) if headers.get("content-encoding") == "gzip" else body
    assert status == 200, body[:500]
    return body


def _check_metrics(body: bytes) -> str:
    text = body.decode("utf-8")  # strict: the answer is valid UTF-8
    check = subprocess.run(["promtool", "check", "metrics"], input=body, capture_output=True)
    assert b"error" not in check.stderr.lower(), check.stderr.decode(errors="replace")[:2000]
    return text


@pytest.fixture
def blkio_cgroup():
    """A real blkio cgroup (v1, as here and in CI) named in bytes that are not UTF-8; None where there is none."""
    root = b"/sys/fs/cgroup/blkio"
    if os.geteuid() != 0 or not os.path.isdir(root):
        yield None
        return
    path = os.path.join(root, b"gpuio-test-" + BAD)
    os.makedirs(path, exist_ok=True)
    yield path
    for _ in range(50):
        try:
            os.rmdir(path)
            return
        except OSError:
            time.sleep(0.1)


@pytest.fixture
def odd_mount(tmp_path: Path):
    """A tmpfs mounted at a directory whose name is not UTF-8 (root only: mount(2))."""
    if os.geteuid() != 0:
        yield None
        return
    point = os.path.join(os.fsencode(tmp_path), b"mnt-" + BAD)
    os.makedirs(point)
    if subprocess.run([b"mount", b"-t", b"tmpfs", b"-o", b"size=16m", b"tmpfs", point]).returncode != 0:
        yield None
        return
    yield point
    subprocess.run([b"umount", b"-l", point], check=False)


def test_names_that_are_not_utf8_leave_every_answer_whole(tmp_path: Path, blkio_cgroup, odd_mount) -> None:
    include = os.fsencode(tmp_path / "models")
    paths = [_model(include)] + ([_model(os.path.join(odd_mount, b"models"))] if odd_mount else [])
    listed = tmp_path / "gpu-processes"
    exporter = ExporterProcess(["--collector.engines.spool-dir=" + str(tmp_path / "spool"),
                                "--collector.engines.path-include=" + str(tmp_path),
                                "--collector.engines.discover-interval=200ms", "--collector.nvml.slow-interval=1s",
                                "--collector.cgroup_io.interval=1s",
                                "--no-collector.smart", "--no-collector.pods"],
                               env={"GPUIO_FAKE_GPUS": UUID, "GPUIO_FAKE_GPU_PROCESSES": str(listed)},
                               module="tests.e2e.fake_gpu_exporter").start()
    holders: list[subprocess.Popen] = []
    try:
        holders = [_hold(path) for path in paths]
        listed.write_text("".join(f"{holder.pid} {UUID}\n" for holder in holders))
        text = _wait_for(exporter, lambda text: "gpuio_engine_info{" in text and "bad" in text)
        if blkio_cgroup is not None:  # a reader from the disk in the cgroup: its IO names the cgroup
            # Linux 6.10+ counts v1 throttle statistics only where blk-throttle is active on the device: a
            # limit far above what is read (tests/e2e/test_cgroup_io_v1.py says more)
            device = os.stat(paths[0]).st_dev
            with open(os.path.join(blkio_cgroup, b"blkio.throttle.read_bps_device"), "w") as limit:
                limit.write(f"{os.major(device)}:{os.minor(device)} {1 << 40}")
            subprocess.run([b"sh", b"-c", b'echo $$ > "$1/cgroup.procs" && exec dd if="$2" of=/dev/null bs=1M '
                            b"iflag=direct status=none", b"sh", blkio_cgroup, paths[0]], check=True)
            text = _wait_for(exporter, lambda text: f'cgroup="/gpuio-test-{SHOWN}'.replace("\\", "\\\\") in text)
        samples = parse_samples(text)
        engines = {dict(labels).get("engine") for name, labels in samples if name == "gpuio_engine_info"}
        assert engines == {SHOWN}, engines
        shown_paths = {dict(labels)["path"] for name, labels in samples if name == "gpuio_engine_info"}
        assert {os.fsdecode(path).encode("utf-8", "surrogateescape").decode("ascii", "backslashreplace")
                for path in paths} == shown_paths
        if blkio_cgroup is not None:
            cgroups = {dict(labels).get("cgroup") for name, labels in samples
                       if name == "gpuio_cgroup_io_read_bytes_total"}
            assert any(SHOWN in (cgroup or "") for cgroup in cgroups), cgroups
        if odd_mount:
            mounts = {dict(labels).get("mountpoint") for name, labels in samples
                      if name == "gpuio_engine_mount_info"}
            assert any(SHOWN in (mount or "") for mount in mounts), mounts

        answer = json.loads(_get(exporter, "/api/v1/engines").decode("utf-8"))
        assert {row["engine"] for row in answer["engines"]} == {SHOWN}
        assert shown_paths == {row["path"] for row in answer["engines"]}

        for holder in holders:  # gone: the history keeps the name, and every answer stays whole
            holder.kill()
            holder.wait()
        time.sleep(1.0)
        _check_metrics(_get(exporter, "/metrics"))
        json.loads(_get(exporter, "/api/v1/engines").decode("utf-8"))
    finally:
        for holder in holders:
            if holder.poll() is None:
                holder.kill()
                holder.wait()
        exporter.stop()


def _wait_for(exporter: ExporterProcess, served, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = _check_metrics(_get(exporter, "/metrics"))
        if served(text):
            return text
        assert time.monotonic() < deadline, [line for line in text.splitlines() if "gpuio_cgroup" in line][-30:]
        time.sleep(0.2)


def test_engines_on_the_node_prints_names_that_are_not_utf8(tmp_path: Path, spool_dir: str) -> None:
    """The library reporting such a name (a path Python read from the OS) must not raise in the process it
    describes, and `gpuio engines` on the node prints it, as a table and as JSON, shown ``\\xNN``."""
    model = os.fsdecode(_model(os.fsencode(tmp_path / "models")))
    engine = gpuio.engine(os.fsdecode(BAD))
    engine.set_info(model)
    engine.observe_inference(0.01)
    printed = {}
    for extra in ([], ["--json"]):
        done = subprocess.run([sys.executable, "-c", GPUIO, "engines", f"--spool-dir={spool_dir}", *extra],
                              capture_output=True, cwd=REPO, timeout=60)
        assert done.returncode == 0, done.stderr.decode(errors="replace")
        printed[bool(extra)] = done.stdout.decode("utf-8")
    assert SHOWN in printed[False], printed[False]
    (row,) = json.loads(printed[True])
    assert row["engine"] == SHOWN and row["path"].endswith(SHOWN + ".plan")
