"""A real exporter process beside a hostile spool writer: what that writer records must not take the other
writers' engines off /metrics, nor hold the scrape.

The hostile writer is this test process writing its spool file with the library's own SpoolFile (any
process may append any well-framed record); the victim is a real instrumented process.  Each case was
a whole-collector failure before: the engines collector raised (a division by zero) or waited on a
path the writer named (a FUSE mount that never answers, as a dead NFS server does).
"""

from __future__ import annotations

import os
import struct
import subprocess
import sys
from collections.abc import Iterator

import pytest

from gpuio import spool as spool_format
from gpuio.spool import SpoolFile
from tests.conftest import REPO, ExporterProcess, parse_samples
from tests.unit.test_load_waterfall import HungFilesystem

pytestmark = [pytest.mark.e2e]

VICTIM = """
import sys
sys.path.insert(0, {repo!r})
import gpuio
gpuio.configure({spool!r})
gpuio.engine("victim").inference_seconds.observe(0.01)
print("ready", flush=True)
sys.stdin.read()  # hold the spool file until the test closes stdin
"""
VICTIM_SERIES = ("gpuio_engine_inference_seconds_count", frozenset({("engine", "victim"), ("gpu_uuid", "")}))


@pytest.fixture
def spool(tmp_path) -> Iterator[str]:
    directory = tmp_path / "spool"
    directory.mkdir()
    victim = subprocess.Popen([sys.executable, "-c", VICTIM.format(repo=str(REPO), spool=str(directory))],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert victim.stdout is not None and victim.stdout.readline().strip() == "ready"
    yield str(directory)
    assert victim.stdin is not None
    victim.stdin.close()
    victim.wait(10)


def engines_served(exporter: ExporterProcess) -> dict:
    samples = parse_samples(exporter.scrape())
    assert samples.get(("gpuio_scrape_collector_success", frozenset({("collector", "engines")}))) == 1
    return samples


def test_a_waterfall_whose_throughput_rounds_to_zero_does_not_take_the_engines_off(spool: str) -> None:
    hostile = SpoolFile(spool)
    values = [0.0] * len(spool_format.WATERFALL_SLOTS)
    for name, value in (("cold_device_bytes", 5e-324), ("cold_read_seconds", 1e10), ("residency_method", 1.0),
                        ("file_bytes", 4096.0)):
        values[spool_format.WATERFALL[name]] = value
    with hostile.lock:
        hostile.add_record(spool_format.KIND_ENGINE, "hostile", spool_format.ENGINE_LAYOUT.size * 8)
        hostile.add_record(spool_format.KIND_WATERFALL, "hostile", len(values) * 8,
                           struct.pack(f"<{len(values)}d", *values))
    exporter = ExporterProcess([f"--collector.engines.spool-dir={spool}"]).start()
    try:
        assert engines_served(exporter)[VICTIM_SERIES] == 1
    finally:
        exporter.stop()
        hostile.close()


def test_a_layer_under_a_mount_that_never_answers_does_not_hold_the_scrape(spool: str) -> None:
    hung = HungFilesystem()
    hostile = SpoolFile(spool)
    dev = (0, 4242)
    with hostile.lock:
        hostile.add_record(spool_format.KIND_ENGINE, "hostile", spool_format.ENGINE_LAYOUT.size * 8)
        info = spool_format.pack_info(0, dev, 7, 4096, 1, 1.0, "/opt/model/hostile.engine", "", "tensorrt")
        hostile.add_record(spool_format.KIND_INFO, "hostile", len(info), info)
        mount = spool_format.pack_mount("/", "overlay", "overlay",
                                        os.path.join(hung.mountpoint, "snapshots", "7", "fs"))
        hostile.add_record(spool_format.KIND_MOUNT, f"hostile\0{dev[0]}:{dev[1]}", len(mount), mount)
    exporter = ExporterProcess([f"--collector.engines.spool-dir={spool}"]).start()
    try:
        for _ in range(2):  # the second scrape too: no collector thread left waiting on the mount
            assert engines_served(exporter)[VICTIM_SERIES] == 1
    finally:
        exporter.stop()
        hung.release()
        hostile.close()
