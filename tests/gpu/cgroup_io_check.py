"""cgroup_io on a real cgroup v2 host (the GPU machine): real cgroups, real readers, the host's real disk.

The cgroup v1 path is tested in CI (tests/e2e/test_cgroup_io_v1.py); CI machines have no cgroup v2 io
controller to write to, this host does.

1. **Bytes per cgroup.**  A parent cgroup of this check's own under /sys/fs/cgroup, with the io controller
   enabled for its children (``+io`` in its cgroup.subtree_control, and in the root's if it is not there),
   and two children.  A reader process is put into each (its pid written into the child's cgroup.procs while
   it waits) and reads a file of its own with O_DIRECT: READ_MIB[0] and READ_MIB[1] MiB, from a file system on
   the host's disk (SCRATCH), or, where SCRATCH has no block device under it, straight from a loop device.
   The collector runs in this process against the real /sys (built from flags as the server builds it), one
   sample before the reads and one after.  Expected: each reader's cgroup is served on the disk with read
   bytes within 5 % of what it read, and with its io.pressure totals.
2. **Pressure.**  The second child gets ``io.max rbps=THROTTLE_BPS`` on the disk and reads THROTTLE_MIB MiB
   again: its reads wait in blk-throttle, the reader sleeps in IO wait, and its io.pressure "some" total must
   rise by at least half the time the throttle holds it (THROTTLE_MIB / THROTTLE_BPS seconds), as served by the
   collector; the unthrottled sibling's must rise by far less.

    python3 tests/gpu/cgroup_io_check.py          # as root, from the repository root

Prints the figures (bytes read, counted, difference, IOs; pressure before and after) and PASS/FAIL lines;
exit 1 on a failure.  Everything made is removed afterwards (cgroups, files, loop device), and the root's
subtree_control is put back as it was.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import textwrap
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.join(REPO, "exporter", "instrument"))

from exporter.assemble import build_scraper  # noqa: E402
from exporter.config import parse_args  # noqa: E402
from exporter.exposition import render  # noqa: E402
from exporter.host import cgroups  # noqa: E402
from exporter.host.blockdev import BlockDevices, PathDevices  # noqa: E402
from tests.peers import write_random  # noqa: E402

ROOT = "/sys/fs/cgroup"
SCRATCH = "/var/tmp"
READ_MIB = (512, 128)
THROTTLE_MIB = 48
THROTTLE_BPS = 8 << 20  # 6 s for THROTTLE_MIB
TOLERANCE = 0.05

READER = textwrap.dedent("""
    import mmap, os, sys
    path, offset, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    sys.stdin.readline()
    buffer = mmap.mmap(-1, 1 << 20)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    os.lseek(fd, offset, os.SEEK_SET)
    total = 0
    while total < size:
        got = os.readv(fd, [buffer])
        if not got:
            break
        total += got
    os.close(fd)
    print(total, flush=True)
""")


class Check:
    def __init__(self) -> None:
        self.failures = 0

    def verdict(self, ok: bool, what: str) -> None:
        print(f"{'PASS' if ok else 'FAIL'} {what}", flush=True)
        self.failures += not ok


def whole_disk(device: str) -> str:
    """The disk io.stat counts a device's IO under: a partition's disk (io.stat keys whole disks)."""
    found = BlockDevices("/sys").get(device)
    return found.parent if found is not None and found.parent else device


class Source:
    """Where the readers read: files on SCRATCH's disk, or regions of a loop device."""

    def __init__(self, work: str) -> None:
        self.work = work
        self.loop: str | None = None
        device = PathDevices("/sys").of_path(work).device
        if device:
            self.disk = whole_disk(device)
            self.paths = [os.path.join(work, f"reader-{index}") for index in range(len(READ_MIB))]
            for path, mib in zip(self.paths, READ_MIB, strict=True):
                write_random(path, mib)
            self.offsets = [0] * len(READ_MIB)
        else:  # no block device under SCRATCH (tmpfs, overlay on one): a loop device's own blocks
            backing = os.path.join(work, "backing.img")
            write_random(backing, sum(READ_MIB))
            self.loop = subprocess.run(["losetup", "--find", "--show", backing], check=True, capture_output=True,
                                       text=True).stdout.strip()
            self.disk = os.path.basename(self.loop)
            self.paths = [self.loop] * len(READ_MIB)
            self.offsets = [sum(READ_MIB[:index]) << 20 for index in range(len(READ_MIB))]
        with open(f"/sys/block/{self.disk}/dev") as handle:
            self.number = handle.read().strip()

    def close(self) -> None:
        if self.loop:
            subprocess.run(["losetup", "--detach", self.loop], check=False)


def read_in(cgroup: str, path: str, offset: int, size: int) -> tuple[int, float]:
    """Start a reader, put it into ``cgroup``, let it read; (bytes it read, seconds it took)."""
    reader = subprocess.Popen([sys.executable, "-c", READER, path, str(offset), str(size)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        with open(os.path.join(cgroup, "cgroup.procs"), "w") as procs:
            procs.write(str(reader.pid))
        started = time.monotonic()
        output, _ = reader.communicate("go\n", timeout=600)
        took = time.monotonic() - started
    finally:
        if reader.poll() is None:
            reader.kill()
            reader.wait()
    if reader.returncode != 0:
        raise RuntimeError(f"reader failed ({reader.returncode}): {output}")
    return int(output), took


def enable_io(directory: str) -> bool:
    """``+io`` in a cgroup's subtree_control; True if this call added it."""
    path = os.path.join(directory, "cgroup.subtree_control")
    with open(path) as handle:
        if "io" in handle.read().split():
            return False
    with open(path, "w") as handle:
        handle.write("+io")
    return True


class Collector:
    """The cgroup_io collector as the server builds it, on this host's /sys."""

    def __init__(self) -> None:
        config = parse_args(["--collector.disable-defaults", "--collector.cgroup_io", "--collector.cgroup_io.top=50",
                             "--web.disable-exporter-metrics"], environ={})
        self.scraper = build_scraper(config)
        self.collector = self.scraper.states["cgroup_io"].collector

    def sample(self) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        snapshot = self.collector.sampler.sample_now()  # type: ignore[attr-defined]
        if snapshot.error is not None:
            raise RuntimeError(snapshot.error)
        return parse_exposition(render(self.scraper.scrape_sync()))


def _unescaped(value: str) -> str:
    return re.sub(r"\\(.)", lambda match: "\n" if match[1] == "n" else match[1], value) if "\\" in value else value


def parse_exposition(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """(name, labels) -> value of a text exposition (label values without quotes or commas; their escapes
    \\\\ and \\n read back)."""
    samples: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name_labels, value = line.rsplit(" ", 1)
        name, _, labels = name_labels.partition("{")
        pairs = [item.split("=", 1) for item in labels.rstrip("}").split('",') if item]
        samples[(name, frozenset((key, _unescaped(raw.strip('"'))) for key, raw in pairs))] = float(value)
    return samples


def value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, frozenset(labels.items())))


def main() -> int:
    if os.geteuid() != 0:
        print("FAIL needs root (cgroups, O_DIRECT files, losetup)")
        return 1
    hierarchy = cgroups.find_hierarchy("/sys")
    if hierarchy is None or hierarchy.version != cgroups.V2:
        print(f"FAIL /sys/fs/cgroup is not cgroup v2 here ({hierarchy}); the v1 path is tests/e2e/test_cgroup_io_v1.py")
        return 1
    with open(os.path.join(ROOT, "cgroup.controllers")) as handle:
        if "io" not in handle.read().split():
            print("FAIL the io controller is not available in this cgroup v2 tree (it is bound to v1?)")
            return 1
    check = Check()
    work = tempfile.mkdtemp(prefix="gpuio-cgroup-io-", dir=SCRATCH)
    parent = os.path.join(ROOT, f"gpuio-check-{os.getpid()}")
    made: list[str] = []
    added_root_io = False
    source: Source | None = None
    try:
        source = Source(work)
        added_root_io = enable_io(ROOT)
        os.mkdir(parent)
        made.append(parent)
        enable_io(parent)
        children = [os.path.join(parent, f"reader-{index}") for index in range(len(READ_MIB))]
        for child in children:
            os.mkdir(child)
            made.append(child)
        labels = [f"/{os.path.basename(parent)}/{os.path.basename(child)}" for child in children]
        print(f"kernel {os.uname().release}; disk {source.disk} ({source.number}); readers read "
              f"{'files on ' + SCRATCH if source.loop is None else 'the loop device ' + source.loop} with O_DIRECT; "
              f"cgroups {', '.join(labels)}", flush=True)

        collector = Collector()
        collector.sample()  # the walks before the IO
        read = [read_in(child, path, offset, mib << 20)[0]
                for child, path, offset, mib in zip(children, source.paths, source.offsets, READ_MIB, strict=True)]
        after = collector.sample()
        print(f"{'cgroup':<36} {'read (bytes)':>14} {'counted':>14} {'diff':>8} {'reads':>8} {'waiting s':>10}")
        for label, expected in zip(labels, read, strict=True):
            counted = value(after, "gpuio_cgroup_io_read_bytes_total", cgroup=label, device=source.disk)
            reads = value(after, "gpuio_cgroup_io_reads_completed_total", cgroup=label, device=source.disk)
            waiting = value(after, "gpuio_cgroup_io_pressure_waiting_seconds_total", cgroup=label)
            difference = (counted - expected) / expected if counted is not None else float("nan")
            print(f"{label:<36} {expected:>14} {counted!s:>14} {difference:>+8.2%} {reads!s:>8} {waiting!s:>10}")
            check.verdict(counted is not None and abs(counted - expected) <= TOLERANCE * expected,
                          f"{label}: read bytes on {source.disk} within {TOLERANCE:.0%} of what its reader read")
            check.verdict(waiting is not None and value(after, "gpuio_cgroup_io_pressure_stalled_seconds_total",
                                                        cgroup=label) is not None,
                          f"{label}: io.pressure totals served")
        info = {dict(key).get("cgroup") for (name, key) in after if name == "gpuio_cgroup_info"}
        check.verdict(f"/{os.path.basename(parent)}" not in info,
                      "the parent, whose io.stat repeats its children's, is not served")

        # 2. The second reader throttled by io.max: its wait in blk-throttle is IO pressure.
        throttled, calm = labels[1], labels[0]
        with open(os.path.join(children[1], "io.max"), "w") as handle:
            handle.write(f"{source.number} rbps={THROTTLE_BPS}")
        before = after
        got, took = read_in(children[1], source.paths[1], source.offsets[1], THROTTLE_MIB << 20)
        after = collector.sample()
        held = (THROTTLE_MIB << 20) / THROTTLE_BPS
        rise = {label: (value(after, "gpuio_cgroup_io_pressure_waiting_seconds_total", cgroup=label) or 0.0)
                - (value(before, "gpuio_cgroup_io_pressure_waiting_seconds_total", cgroup=label) or 0.0)
                for label in labels}
        full_rise = ((value(after, "gpuio_cgroup_io_pressure_stalled_seconds_total", cgroup=throttled) or 0.0)
                     - (value(before, "gpuio_cgroup_io_pressure_stalled_seconds_total", cgroup=throttled) or 0.0))
        print(f"throttled read: {got} bytes in {took:.1f} s at io.max rbps={THROTTLE_BPS} (expected ~{held:.1f} s); "
              f"io.pressure some rose {rise[throttled]:.2f} s (full {full_rise:.2f} s) for {throttled}, "
              f"{rise[calm]:.2f} s for {calm}", flush=True)
        check.verdict(took >= 0.5 * held, "io.max held the reader back (the throttle is in force)")
        check.verdict(rise[throttled] >= 0.5 * held,
                      f"{throttled}: io.pressure some rose by at least half the throttled time")
        check.verdict(rise[calm] < 0.25 * rise[throttled], f"{calm}: its pressure did not rise with its sibling's")
    except Exception as exc:  # a figure the check could not take is a failure, with what went wrong
        check.verdict(False, f"{type(exc).__name__}: {exc}")
    finally:
        for directory in reversed(made):
            try:
                os.rmdir(directory)
            except OSError as exc:
                print(f"could not remove {directory}: {exc}")
        if added_root_io:
            try:
                with open(os.path.join(ROOT, "cgroup.subtree_control"), "w") as handle:
                    handle.write("-io")
            except OSError as exc:
                print(f"could not take io back out of {ROOT}/cgroup.subtree_control: {exc}")
        if source is not None:
            source.close()
        subprocess.run(["rm", "-rf", work], check=False)
    print("OK" if not check.failures else f"{check.failures} FAILED", flush=True)
    return 1 if check.failures else 0


if __name__ == "__main__":
    sys.exit(main())
