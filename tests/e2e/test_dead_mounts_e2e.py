"""A model file on a mount whose server stopped answering (a dead NFS export, a hung FUSE daemon), held open by
a process: discovery's passes keep ending, `gpuio engines` answers, and the exporter keeps serving.

The mount is tests/fuse_stub.py's real FUSE file system, frozen: from then on every stat() or lookup on it
waits, as on a dead server (a stat through /proc/<pid>/fd/<n> too).  A stat through the descriptor in a pass
once froze discovery for good and hung `gpuio engines`.  Everything that may wait here runs where the test can
give up on it (a thread, a subprocess), so a regression fails the test instead of hanging the suite.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from exporter.engines.discovery import Discovery
from tests.conftest import REPO, ExporterProcess, parse_samples
from tests.e2e.loaders import model

pytestmark = [pytest.mark.e2e, pytest.mark.root]

GPUIO = "from exporter.cli import tools_main; tools_main()"  # the `gpuio` console script
GIVE_UP_S = 30.0  # far past any pass: a pass still running then is waiting on the mount
UUID = "GPU-deadbeef-0000-0000-0000-000000000001"


def _held_on_a_dead_mount(fuse_stub, loaders):
    """A process holding model.plan open on a FUSE mount, which is then frozen; (stub, holder).  The test asks
    for ``loaders`` before ``fuse_stub``, so the stub is closed first at teardown: a process on a frozen mount
    cannot exit (closing its file waits on the daemon) until it is."""
    stub = fuse_stub(files={"model.plan": 4 << 20})
    holder = loaders()
    holder.do("open", os.path.join(stub.mountpoint, "model.plan"))
    holder.do("read", os.path.join(stub.mountpoint, "model.plan"), 1 << 20)
    stub.freeze()
    return stub, holder


def _within(seconds: float, work):
    """work()'s result, or a failure if it has not returned within ``seconds`` (it is left running)."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(work()), daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still waiting after {seconds:g} s: it waits on the dead mount"
    return result[0]


def _gpuio_engines(spool: str, *flags: str) -> str:
    """What `gpuio engines --json` prints, run as a process; a failure if it waits past GIVE_UP_S."""
    try:
        done = subprocess.run([sys.executable, "-c", GPUIO, "engines", "--json", f"--spool-dir={spool}", *flags],
                              capture_output=True, text=True, cwd=REPO, timeout=GIVE_UP_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"gpuio engines still waiting after {GIVE_UP_S:g} s: it waits on the dead mount")
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_discovery_passes_end_while_a_model_sits_on_a_dead_mount(loaders, fuse_stub, tmp_path) -> None:
    local = model(tmp_path, "models/local/1/model.plan")
    stub, holder = _held_on_a_dead_mount(fuse_stub, loaders)
    server = loaders()
    found = Discovery([stub.mountpoint, str(tmp_path)], require_gpu=False, join_within=0.0)
    _within(GIVE_UP_S, found.sample)
    server.do("open", local)  # a server on a local disk, beside the dead mount: still followed
    server.do("read", local, 4096)
    for _ in range(3):
        discovered = _within(GIVE_UP_S, found.sample)
    assert "local" in discovered.totals.infos
    assert discovered.figures.unresponsive_mounts == 1
    assert dict(discovered.figures.dropped).get("unresponsive_mount", 0) >= 1
    assert holder.pid and stub.requests["GETATTR"] >= 0  # the stub answered nothing since the freeze


def test_gpuio_engines_answers_while_a_model_sits_on_a_dead_mount(loaders, fuse_stub, tmp_path) -> None:
    stub, _ = _held_on_a_dead_mount(fuse_stub, loaders)
    spool = tmp_path / "spool"
    spool.mkdir()
    _gpuio_engines(str(spool), f"--path-include={stub.mountpoint}")


def test_the_exporter_serves_on_while_a_model_sits_on_a_dead_mount(loaders, fuse_stub, tmp_path) -> None:
    """The real exporter (its NVML the fake, listing the holder on its GPU): every scrape answers, the engines
    collector stays ok, and the dead mount is counted."""
    stub, holder = _held_on_a_dead_mount(fuse_stub, loaders)
    listed = tmp_path / "gpu-processes"
    listed.write_text(f"{holder.pid} {UUID}\n")
    exporter = ExporterProcess(["--collector.disable-defaults", "--collector.engines", "--collector.nvml",
                                f"--collector.engines.spool-dir={tmp_path / 'spool'}",
                                f"--collector.engines.path-include={stub.mountpoint}",
                                "--collector.engines.discover-interval=200ms", "--collector.nvml.slow-interval=1s",
                                "--collector.engines.residency-interval=1s"],
                               env={"GPUIO_FAKE_GPUS": UUID, "GPUIO_FAKE_GPU_PROCESSES": str(listed)},
                               module="tests.e2e.fake_gpu_exporter").start()
    try:
        deadline = time.monotonic() + GIVE_UP_S
        while True:
            samples = parse_samples(exporter.scrape())
            if samples.get(("gpuio_engine_discovery_unresponsive_mounts", frozenset())) == 1:
                break
            assert time.monotonic() < deadline, sorted(
                (name, value) for (name, _), value in samples.items() if "discovery" in name)
            time.sleep(0.2)
        time.sleep(2.0)  # several passes and scans later
        samples = parse_samples(exporter.scrape())
        state = {dict(labels)["state"]: value for (name, labels), value in samples.items()
                 if name == "gpuio_scrape_collector_state" and dict(labels).get("collector") == "engines"}
        assert state.get("ok") == 1, state
        passed = samples[("gpuio_engine_discovery_timestamp_seconds", frozenset())]
        assert time.time() - passed < 5, "discovery's passes stopped"
    finally:
        exporter.stop()


def test_a_file_a_writer_named_on_a_dead_mount_holds_neither_gpuio_engines_nor_the_scan(
        loaders, fuse_stub, spool_dir, tmp_path) -> None:
    """The library reported its engine's file, on a mount that then stopped answering: `gpuio engines` still
    answers (the file's residency is unavailable, unresponsive_mount), as does the collector's scan."""
    import gpuio

    stub = fuse_stub(files={"model.plan": 4 << 20})
    engine = gpuio.engine("on-nfs")
    engine.set_info(os.path.join(stub.mountpoint, "model.plan"))
    engine.observe_inference(0.01)
    stub.freeze()
    (row,) = json.loads(_gpuio_engines(spool_dir, f"--path-include={stub.mountpoint}"))
    assert row["engine"] == "on-nfs" and row["residency_unavailable"] == "unresponsive_mount", row


def test_a_load_followed_when_its_mount_dies_stays_in_progress(loaders, fuse_stub) -> None:
    """A server reading its model from a mount that then stops answering: its load is still in progress (the
    file is still held: fdinfo and the link say so, and its inode is the same), not taken for closed."""
    stub = fuse_stub(files={"model.plan": 4 << 20})
    path = os.path.join(stub.mountpoint, "model.plan")
    found = Discovery([stub.mountpoint], require_gpu=False, join_within=0.0)
    found.sample()
    server = loaders()
    server.do("open", path)
    server.do("read", path, 1 << 20)
    before = _within(GIVE_UP_S, found.sample).totals.loads
    assert [count for count, _, _ in before.values()] == [1]
    stub.freeze()
    after = _within(GIVE_UP_S, found.sample).totals.loads
    assert after.keys() == before.keys() and [count for count, _, _ in after.values()] == [1]


def test_a_path_glob_on_a_dead_mount_holds_neither_gpuio_engines_nor_the_scan(loaders, fuse_stub,
                                                                               tmp_path) -> None:
    """`--path` names files by a pattern: one whose directory stopped answering matches nothing this time."""
    stub = fuse_stub(files={"model.plan": 4 << 20})
    stub.freeze()
    spool = tmp_path / "spool"
    spool.mkdir()
    _gpuio_engines(str(spool), f"--path={stub.mountpoint}/*.plan")


def test_an_overlay_over_a_dead_fuse_layer_holds_no_pass(loaders, fuse_stub, tmp_path) -> None:
    """An overlay whose lower layer is FUSE (a lazy-pulling snapshotter's image): a stat through the overlay
    asks the FUSE daemon, so an overlay is no file system a pass may stat in line."""
    stub = fuse_stub(files={"model.plan": 4 << 20})
    merged, upper, work = (tmp_path / name for name in ("merged", "upper", "work"))
    for directory in (merged, upper, work):
        directory.mkdir()
    mounted = subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                              f"lowerdir={stub.mountpoint},upperdir={upper},workdir={work}", str(merged)])
    if mounted.returncode != 0:
        pytest.skip("this kernel does not stack an overlay on FUSE")
    try:
        holder = loaders()
        holder.do("open", str(merged / "model.plan"))
        holder.do("read", str(merged / "model.plan"), 1 << 20)
        found = Discovery([str(merged)], require_gpu=False, join_within=0.0)
        _within(GIVE_UP_S, found.sample)
        stub.freeze()
        fresh = Discovery([str(merged)], require_gpu=False, join_within=0.0)  # one that has not stat'ed the file yet
        _within(GIVE_UP_S, fresh.sample)
        _within(GIVE_UP_S, found.sample)
    finally:
        stub.close()  # first: the holder cannot exit while its file's daemon hangs
        subprocess.run(["umount", "-l", str(merged)], check=False)


# Opens its argument O_CLOEXEC, says so, and on a line from stdin execs sleep: the exec closes the file, which
# on a FUSE mount asks the daemon (FLUSH), so with the daemon hung the process stays in execve.
EXEC_ON_FUSE = ("import os, sys\n"
                "fd = os.open(sys.argv[1], os.O_RDONLY | os.O_CLOEXEC)\n"
                "print('open', flush=True)\n"
                "sys.stdin.readline()\n"
                "os.execv('/bin/sleep', ['sleep', '60'])\n")


def test_a_process_stuck_in_execve_on_a_dead_mount_holds_no_pass(loaders, fuse_stub, tmp_path) -> None:
    """A process stuck in execve (closing a file of a hung FUSE daemon) makes a reader of its /proc/<pid>/stat
    and io wait; the pass skips it, counted, and goes on to find a server beside it."""
    stub = fuse_stub(files={"f.bin": 1 << 20})
    stuck = subprocess.Popen([sys.executable, "-c", EXEC_ON_FUSE, os.path.join(stub.mountpoint, "f.bin")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert stuck.stdout is not None and stuck.stdin is not None and stuck.stdout.readline().strip() == "open"
        stub.freeze()
        stuck.stdin.write("go\n")
        stuck.stdin.flush()
        time.sleep(0.5)  # it is in execve now, waiting on the daemon
        local = model(tmp_path, "models/local/1/model.plan")
        found = Discovery([str(tmp_path)], require_gpu=False, join_within=0.0)
        _within(GIVE_UP_S, found.sample)
        server = loaders()
        server.do("open", local)
        server.do("read", local, 4096)
        discovered = _within(GIVE_UP_S, found.sample)
        assert "local" in discovered.totals.infos
        assert dict(discovered.figures.dropped).get("unresponsive_process", 0) >= 1
    finally:
        stub.close()  # first: the stuck process can only be reaped once its daemon's connection is gone
        stuck.kill()
        stuck.wait()
