"""promtool check metrics on the engines collector's output."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from exporter.collectors import engines  # noqa: F401  (registers the collector)
from gpuio import metrics
from gpuio import spool as spool_format
from tests.conftest import parse_samples
from tests.unit.test_engines import busy_engine, collector, scrape

pytestmark = pytest.mark.e2e

PROMTOOL = shutil.which("promtool")


@pytest.mark.skipif(PROMTOOL is None, reason="promtool is not installed")
def test_promtool_check_metrics_is_clean(spool_dir, tmp_path) -> None:
    busy_engine(tmp_path)
    (tmp_path / "spool" / "gpuio-1-1-bad.spool").write_bytes(b"")
    target = collector(spool_dir, path=(str(tmp_path / "*.engine"),))
    target.collect()
    target.service.files.scanner.sample_now()
    result = subprocess.run([PROMTOOL, "check", "metrics"], input=scrape(target), capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_writer_cannot_claim_another_process_as_its_own(spool_dir, tmp_path) -> None:
    """A spool file's header says which process wrote it (pid, start time): the writer's word.  Claiming a
    live process of this machine (here a sleeping child) joined that process's GPU series to the
    writer's engine (gpuio_engine_process_info) and lent the writer that process's GPU.  The claim
    stands only where the kernel's lock table shows that pid holding the file's lock."""
    from exporter.host import procstat

    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = 0
        while not start:  # the child's stat exists once it runs
            start = procstat.start_ticks(victim.pid)
        hostile = spool_format.SpoolFile(spool_dir)
        fields = list(spool_format.HEADER.unpack_from(hostile._map))
        fields[5], fields[7] = victim.pid, start  # pid, start ticks
        spool_format.HEADER.pack_into(hostile._map, 0, *fields)
        metrics.EngineMetrics("impostor", hostile).inference_seconds.observe(0.001)
        target = collector(spool_dir)
        target.context.gpu_processes.update({(victim.pid, start): "GPU-of-the-victim"})
        samples = parse_samples(scrape(target))
        hostile.close()
    finally:
        victim.kill()
        victim.wait()
    assert samples[("gpuio_engine_inference_seconds_count",
                    frozenset({("engine", "impostor"), ("gpu_uuid", "")}))] == 1  # its values count, unattributed
    assert [ls for (name, ls), _ in samples.items() if name == "gpuio_engine_process_info"] == []
    assert not [ls for (name, ls), _ in samples.items() if ("gpu_uuid", "GPU-of-the-victim") in ls]
