"""A discovery whose passes stop ending is a state of the engines collector, not a silent freeze.

A pass never waits on a file system (exporter.engines.descriptors) nor on a process's stat, but a kernel
interface that does not answer can still hold one: here a procfs tree in which a process holds a model file
whose ``fdinfo`` is a FIFO with no writer, which makes the pass's open() wait, as a real one would.  The
engines collector must then say ``stale`` (its success 0, so GpuioCollectorFailing fires) and keep serving
what the spool says.
"""

from __future__ import annotations

import os
import time

from exporter.collect import StaleData
from exporter.collectors import engines
from exporter.context import Context
from exporter.engines import service


def test_a_pass_that_never_ends_makes_the_collector_stale(tmp_path, monkeypatch) -> None:
    procfs = tmp_path / "proc"
    (procfs / "4242" / "fd").mkdir(parents=True)
    (procfs / "4242" / "fdinfo").mkdir()
    (procfs / "uptime").write_text("100.00 50.00\n")
    (procfs / "4242" / "stat").write_text("4242 (server) S " + " ".join(["1"] * 50) + "\n")
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "m.plan").write_bytes(b"\0" * (1 << 20))
    os.symlink(tmp_path / "models" / "m.plan", procfs / "4242" / "fd" / "3")
    fifo = procfs / "4242" / "fdinfo" / "3"
    os.mkfifo(fifo)  # opening it for reading waits for a writer: for ever
    spool = tmp_path / "spool"
    spool.mkdir()
    monkeypatch.setattr(service, "DISCOVERY_STUCK_SECONDS", 0.3)
    settings = {option.name: option.parse(option.default) if option.default is not None else None
                for option in engines.EnginesCollector.options}
    settings.update({"spool-dir": str(spool), "discover": True, "discover-interval": 0.02,
                     "path-include": [str(tmp_path / "models")]})
    collector = engines.EnginesCollector(Context(procfs=str(procfs)), settings)
    collector.start()
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                collector.collect()
            except StaleData as stale:
                assert "discovery's last pass ended" in str(stale)
                assert any(family.desc.name == "gpuio_engine_spool_processes" for family in stale.families)
                break
            assert time.monotonic() < deadline, "the collector never said its discovery was stuck"
            time.sleep(0.1)
    finally:
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))  # a writer comes and goes: the pass goes on
        collector.stop()
