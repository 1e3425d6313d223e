"""cgroup_io on a real cgroup v1 blkio hierarchy: real cgroups, real readers, a real block device.

Setup (root): a loop device over a file, ext4 on it, two files of random data written and fsync'ed.  Two
child cgroups under a parent of this test's own in ``/sys/fs/cgroup/blkio``, a reader process put into each
(its pid written into the cgroup's ``cgroup.procs`` while it waits), each reading its own file with O_DIRECT
(nothing from the page cache: every byte read is a bio to the loop device, charged to the reader's cgroup).
The readers read different amounts.

Linux 6.10+ counts the v1 throttle statistics (``blkio.throttle.io_service_bytes``) only on a device where
blk-throttle is active (a limit was once set on it, in any cgroup: exporter/host/cgroups.py), so each test cgroup
gets a read limit on the loop device far above what it reads (1 TiB/s), which activates it and limits nothing.

Expected: the collector, built from flags as the server builds it, serves each reader's cgroup among the
top cgroups of the loop device, with read bytes within 5 % of what the reader read (the rest: ext4's reads of
the inode and extent blocks on open), and the parent, whose own tasks did no IO, not at all.  Everything made
is removed afterwards: the readers have exited, the cgroups are removed, the file system unmounted, the loop
device detached.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import textwrap

import pytest

from exporter.assemble import build_scraper
from exporter.config import parse_args
from exporter.exposition import render
from exporter.host import cgroups
from tests.conftest import parse_samples, undeclared
from tests.peers import write_random

pytestmark = [pytest.mark.e2e, pytest.mark.root]

BLKIO = "/sys/fs/cgroup/blkio"
READERS = {"reader-a": 96, "reader-b": 24}  # MiB each reads
TOLERANCE = 0.05
NO_LIMIT = 1 << 40  # bytes/s: activates blk-throttle on the device without slowing anything

# Waits for a line on stdin (its pid is put into its cgroup meanwhile), then reads the whole file with O_DIRECT
# through a page-aligned buffer, and prints how many bytes it read.
READER = textwrap.dedent("""
    import mmap, os, sys
    sys.stdin.readline()
    buffer = mmap.mmap(-1, 1 << 20)
    fd = os.open(sys.argv[1], os.O_RDONLY | os.O_DIRECT)
    total = 0
    while True:
        got = os.readv(fd, [buffer])
        if not got:
            break
        total += got
    os.close(fd)
    print(total, flush=True)
""")


def _require() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root: cgroups, losetup, mount")
    hierarchy = cgroups.find_hierarchy("/sys")
    if hierarchy is None or hierarchy.version != cgroups.V1:
        pytest.skip("no cgroup v1 blkio hierarchy at /sys/fs/cgroup/blkio (cgroup v2: tests/gpu/cgroup_io_check.py)")
    missing = [tool for tool in ("losetup", "mkfs.ext4", "mount", "umount") if shutil.which(tool) is None]
    if missing:
        pytest.skip(f"needs {', '.join(missing)} (util-linux, e2fsprogs)")


def _run(*command: str) -> str:
    return subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip()


def _read_in_cgroup(cgroup_dir: str, path: str) -> int:
    """Start a reader, put it into ``cgroup_dir``, let it read ``path``; the bytes it read."""
    reader = subprocess.Popen([sys.executable, "-c", READER, path], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        with open(os.path.join(cgroup_dir, "cgroup.procs"), "w") as procs:
            procs.write(str(reader.pid))
        output, _ = reader.communicate("go\n", timeout=120)
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    assert reader.returncode == 0, output
    return int(output)


def test_bytes_per_cgroup_agree_with_what_each_reader_read() -> None:
    _require()
    workdir = tempfile.mkdtemp(prefix="gpuio-cgroup-io-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    mountpoint = os.path.join(workdir, "mnt")
    parent = os.path.join(BLKIO, f"gpuio-test-{os.getpid()}")
    loop: str | None = None
    mounted = False
    made: list[str] = []
    try:
        backing = os.path.join(workdir, "backing.img")
        with open(backing, "wb") as handle:
            handle.truncate((sum(READERS.values()) + 64) << 20)
        loop = _run("losetup", "--find", "--show", backing)
        _run("mkfs.ext4", "-q", "-F", loop)
        os.mkdir(mountpoint)
        _run("mount", loop, mountpoint)
        mounted = True
        for name, mib in READERS.items():
            write_random(os.path.join(mountpoint, name), mib)
        device = os.path.basename(loop)
        with open(f"/sys/block/{device}/dev") as handle:
            number = handle.read().strip()

        os.mkdir(parent)
        made.append(parent)
        for name in READERS:
            directory = os.path.join(parent, name)
            os.mkdir(directory)
            made.append(directory)
            with open(os.path.join(directory, "blkio.throttle.read_bps_device"), "w") as limit:
                limit.write(f"{number} {NO_LIMIT}")

        config = parse_args(["--collector.disable-defaults", "--collector.cgroup_io", "--collector.cgroup_io.top=10",
                             "--web.disable-exporter-metrics"], environ={})
        scraper = build_scraper(config)
        collector = scraper.states["cgroup_io"].collector
        collector.first_gap = 0.0  # type: ignore[attr-defined]
        collector.sampler.sample_now()  # type: ignore[attr-defined]  # the walks before the IO

        read = {name: _read_in_cgroup(os.path.join(parent, name), os.path.join(mountpoint, name)) for name in READERS}
        snapshot = collector.sampler.sample_now()  # type: ignore[attr-defined]
        assert snapshot.error is None, snapshot.error
        text = render(scraper.scrape_sync())
        scraper.stop()
        assert undeclared(text) == []
        samples = parse_samples(text)

        counted = {}
        print(f"\n{device} ({number}), ext4, files read with O_DIRECT; cgroups under {parent}")
        print(f"{'cgroup':<40} {'read (bytes)':>14} {'counted':>14} {'diff':>8} {'reads':>7}")
        for name, expected in read.items():
            labels = frozenset({"cgroup": f"/{os.path.basename(parent)}/{name}", "device": device}.items())
            counted[name] = samples.get(("gpuio_cgroup_io_read_bytes_total", labels))
            ios = samples.get(("gpuio_cgroup_io_reads_completed_total", labels))
            difference = (counted[name] - expected) / expected if counted[name] is not None else float("nan")
            print(f"{'/' + os.path.basename(parent) + '/' + name:<40} {expected:>14} {counted[name]!s:>14} "
                  f"{difference:>+8.2%} {ios!s:>7}")
        for name, expected in read.items():
            assert expected == READERS[name] << 20, f"{name} read {expected} bytes, not its whole file"
            assert counted[name] is not None, f"{name} is not served:\n{text}"
            assert abs(counted[name] - expected) <= TOLERANCE * expected, (name, counted[name], expected)
        served = {dict(labels)["cgroup"] for (metric, labels) in samples if metric == "gpuio_cgroup_info"}
        assert f"/{os.path.basename(parent)}" not in served  # its own tasks did no IO
        assert {f"/{os.path.basename(parent)}/{name}" for name in READERS} <= served
    finally:
        for directory in reversed(made):
            os.rmdir(directory)  # the readers have exited: the cgroups are empty
        if mounted:
            subprocess.run(["umount", mountpoint], check=False)
        if loop:
            subprocess.run(["losetup", "--detach", loop], check=False)
        shutil.rmtree(workdir, ignore_errors=True)
