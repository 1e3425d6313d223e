"""Soak: 100,000 scrapes while block devices appear and disappear under the exporter.

Needs root (loop devices).  A churn thread keeps creating and deleting loop devices in a range of its
own (loop200-loop215 by default; loop0-7 are left alone): create the device (LOOP_CTL_ADD on
/dev/loop-control), attach a backing file with ``losetup``, read from it, detach with ``losetup -d``
and delete the device (LOOP_CTL_REMOVE), so that it really leaves /proc/diskstats and /sys/block;
a detached loop device that is not deleted stays in both.  The exporter, on this machine's real
/proc and /sys, exports loop devices (``--collector.diskstats.device-include=^loop``), so the set of
devices it renders changes every few scrapes: its per-device caches, sysfs metadata and label
caches are exercised all the time.

A few keep-alive scrapers (4 by default, under the default --web.max-requests) share the 100,000
scrapes; each answer must be HTTP 200 with both collectors at success 1.  Every 1,000 scrapes the
exporter's RSS, open file descriptors and threads are sampled from /proc/<pid>/status, fd/ and task/.

Pass criteria (after warm-up, the first half of the scrapes: RSS climbs ~2.5 MiB in the first
~40,000 scrapes of device churn and then stays flat, see docs/reliability.md): no error; RSS growth from the end of
warm-up to the end under 1 MiB; no file-descriptor growth (the end at most the warm-up figure plus 2,
for a file a scrape in flight may hold open while sampled); no thread growth.

Inference processes come and go too: an engine churn thread keeps starting real instrumented
processes (``gpuio``: a load, a warmed pool, inferences) on a few engine names, each
living about a second; one in four is SIGKILLed rather than left to exit.  The exporter's engines
collector reads their spool files, folds the totals of the dead ones and deletes their files; the
scrapers check that the engines collector succeeds and that its load counter never goes down.

    sudo .venv/bin/python bench/soak.py                     # 100,000 scrapes
    sudo .venv/bin/python bench/soak.py --scrapes 20000     # a quick run
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from load_bench import process_figures, slope_per_minute, start_exporter  # noqa: E402

LOOP_CTL_ADD, LOOP_CTL_REMOVE = 0x4C80, 0x4C81
LOOP_DEVICE = re.compile(rb'gpuio_disk_reads_completed_total\{device="(loop\d+)"\}')
EXPECTED = (b'gpuio_scrape_collector_success{collector="diskstats"} 1\n',
            b'gpuio_scrape_collector_success{collector="pressure"} 1\n',
            b'gpuio_scrape_collector_success{collector="engines"} 1\n')
LOADS = re.compile(rb'gpuio_engine_load_read_seconds_count\{engine="(soak\d)"\} (\S+)')
ENGINE_NAMES = 4
INFERENCE = """
import os, random, signal, sys, time
sys.path.insert(0, {repo!r})
import gpuio
gpuio.configure({spool!r})
loaded = gpuio.load({engine!r}, lambda data: len(data), name=sys.argv[1])
pool = gpuio.EnginePool(loaded.metrics, create=object, size=2, warmup=lambda context: None)
deadline = time.monotonic() + random.uniform(0.5, 1.5)
while time.monotonic() < deadline:
    pool.run(lambda context: time.sleep(0.001), batch_size=random.choice((1, 4, 8)))
if sys.argv[2] == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
"""
REQUEST = b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nUser-Agent: gpuio-soak\r\n\r\n"


class LoopChurn(threading.Thread):
    """Creates, attaches, reads, detaches and deletes loop devices ``first``..``first+count-1`` in turn."""

    def __init__(self, backing: str, first: int, count: int, pause: float) -> None:
        super().__init__(name="loop-churn", daemon=True)
        self.backing, self.minors, self.pause = backing, range(first, first + count), pause
        self.stop = threading.Event()
        self.attached: set[int] = set()
        self.appeared = self.disappeared = 0
        self.failures: list[str] = []
        self.control = os.open("/dev/loop-control", os.O_RDWR)

    def run(self) -> None:
        index = 0
        while not self.stop.is_set():
            minor = self.minors[index % len(self.minors)]
            # Walk the range twice as fast as it fills, so about half the devices exist at any time.
            index += 3
            try:
                if minor in self.attached:
                    self.delete(minor)
                else:
                    self.create(minor)
            except (OSError, subprocess.CalledProcessError) as exc:
                self.failures.append(f"loop{minor}: {exc}")
                if len(self.failures) > 20:
                    return
            self.stop.wait(self.pause)

    def create(self, minor: int) -> None:
        with contextlib.suppress(FileExistsError):
            fcntl.ioctl(self.control, LOOP_CTL_ADD, minor)
        subprocess.run(["losetup", f"/dev/loop{minor}", self.backing], check=True, capture_output=True)
        self.attached.add(minor)
        self.appeared += 1
        fd = os.open(f"/dev/loop{minor}", os.O_RDONLY)
        try:
            os.pread(fd, 256 * 1024, 0)  # some IO, so the device's counters move
        finally:
            os.close(fd)

    def delete(self, minor: int) -> None:
        subprocess.run(["losetup", "-d", f"/dev/loop{minor}"], check=True, capture_output=True)
        self.attached.discard(minor)
        for _ in range(50):  # detaching completes asynchronously: EBUSY for a moment
            try:
                fcntl.ioctl(self.control, LOOP_CTL_REMOVE, minor)
                self.disappeared += 1
                return
            except OSError as exc:
                if exc.errno != errno.EBUSY:
                    raise
                time.sleep(0.01)
        raise OSError(errno.EBUSY, f"loop{minor} stayed busy after detach")

    def cleanup(self) -> None:
        self.stop.set()
        self.join(10)
        for minor in self.minors:
            subprocess.run(["losetup", "-d", f"/dev/loop{minor}"], capture_output=True)
            with contextlib.suppress(OSError):
                fcntl.ioctl(self.control, LOOP_CTL_REMOVE, minor)
        os.close(self.control)


class EngineChurn(threading.Thread):
    """Keeps ``concurrent`` instrumented inference processes alive, each for about a second."""

    def __init__(self, directory: str, concurrent: int) -> None:
        super().__init__(name="engine-churn", daemon=True)
        self.spool = os.path.join(directory, "spool")
        os.mkdir(self.spool)
        self.engine = os.path.join(directory, "model.engine")
        with open(self.engine, "wb") as handle:
            handle.write(os.urandom(1 << 20))
        self.concurrent = concurrent
        self.stop = threading.Event()
        self.started = self.killed = 0
        self.failures: list[str] = []

    def run(self) -> None:
        running: list[subprocess.Popen[bytes]] = []
        code = INFERENCE.format(repo=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                spool=self.spool, engine=self.engine)
        while not self.stop.is_set():
            for process in [process for process in running if process.poll() is not None]:
                running.remove(process)
                if process.returncode not in (0, -9):
                    self.failures.append(f"inference process exited {process.returncode}")
            while len(running) < self.concurrent:
                kill = self.started % 4 == 3
                name = f"soak{self.started % ENGINE_NAMES}"
                running.append(subprocess.Popen([sys.executable, "-c", code, name, "kill" if kill else "exit"],
                                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                self.started += 1
                self.killed += kill
            self.stop.wait(0.05)
        for process in running:
            process.kill()
            process.wait()

    def cleanup(self) -> None:
        self.stop.set()
        if self.ident is not None:  # started (--inference-processes 0 never starts it)
            self.join(10)


@dataclass
class Soak:
    total: int
    done: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    samples: list[tuple[int, float, dict[str, float]]] = field(default_factory=list)  # scrapes, seconds, figures
    device_sets: int = 0  # scrapes whose set of loop devices differed from the previous scrape's
    most_devices: int = 0
    _last_set: frozenset[bytes] = frozenset()
    loads: dict[bytes, float] = field(default_factory=dict)  # the highest load count seen per engine

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


async def scrape_once(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, soak: Soak) -> None:
    writer.write(REQUEST)
    head = await reader.readuntil(b"\r\n\r\n")
    length = re.search(rb"(?i)\r\ncontent-length: (\d+)", head)
    body = await reader.readexactly(int(length[1]) if length else 0)
    if not head.startswith(b"HTTP/1.1 200"):
        soak.error(f"status {head[9:12].decode()}")
    elif not all(line in body for line in EXPECTED):
        soak.error("a collector failed")
    devices = frozenset(LOOP_DEVICE.findall(body))
    if devices != soak._last_set:
        soak.device_sets += 1
        soak._last_set = devices
    soak.most_devices = max(soak.most_devices, len(devices))
    for engine, count in LOADS.findall(body):
        # Scrapers race, so one may report an older count; a drop below a count seen 1,000s of scrapes
        # ago is a real loss (folding a dead process's file lost its totals).
        if float(count) < soak.loads.get(engine, 0.0) - 8:
            soak.error("engine load count went down")
        soak.loads[engine] = max(soak.loads.get(engine, 0.0), float(count))


async def scraper(port: int, soak: Soak, pid: int, started: float, every: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while soak.done < soak.total:
            soak.done += 1
            number = soak.done
            try:
                await asyncio.wait_for(scrape_once(reader, writer, soak), timeout=30)
            except (OSError, asyncio.IncompleteReadError, asyncio.TimeoutError) as exc:
                soak.error(type(exc).__name__)
                writer.close()
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if number % every == 0:
                soak.samples.append((number, time.monotonic() - started, process_figures(pid)))
    finally:
        writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--scrapes", type=int, default=100_000)
    parser.add_argument("--scrapers", type=int, default=4)
    parser.add_argument("--first-loop", type=int, default=200, help="first loop minor of the churn's own range")
    parser.add_argument("--loops", type=int, default=16, help="how many loop minors the churn uses")
    parser.add_argument("--churn-pause", type=float, default=0.02, help="seconds between two device changes")
    parser.add_argument("--sample-every", type=int, default=1000, help="scrapes between RSS/fd/thread samples")
    parser.add_argument("--inference-processes", type=int, default=3,
                        help="instrumented inference processes alive at once (0: no engine churn)")
    parser.add_argument("--warmup", type=int, help="scrapes of warm-up (default: half of --scrapes; "
                                                   "docs/reliability.md says why)")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    if os.geteuid() != 0 or shutil.which("losetup") is None:
        raise SystemExit("needs root and losetup (util-linux): loop devices are created and deleted")

    with tempfile.TemporaryDirectory(prefix="gpuio-soak-") as directory:
        backing = os.path.join(directory, "backing.img")
        with open(backing, "wb") as handle:
            handle.truncate(16 << 20)
        churn = LoopChurn(backing, args.first_loop, args.loops, args.churn_pause)
        engines = EngineChurn(directory, args.inference_processes)
        process, port = start_exporter(["--collector.diskstats.device-include=^loop",
                                        f"--collector.engines.spool-dir={engines.spool}"])
        soak = Soak(args.scrapes)
        started = time.monotonic()
        try:
            churn.start()
            if args.inference_processes:
                engines.start()
            import uvloop

            async def run() -> None:
                soak.samples.append((0, 0.0, process_figures(process.pid)))
                await asyncio.gather(*(scraper(port, soak, process.pid, started, args.sample_every)
                                       for _ in range(args.scrapers)))

            uvloop.run(run())
        finally:
            elapsed = time.monotonic() - started
            churn.cleanup()
            engines.cleanup()
            leftover = len(os.listdir(engines.spool))
            process.terminate()
            _, stderr = process.communicate(timeout=30)
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; exporter pid {process.pid}")
    report(args, soak, churn, engines, leftover, elapsed, stderr)


def report(args: argparse.Namespace, soak: Soak, churn: LoopChurn, engines: EngineChurn, leftover: int,
           elapsed: float, stderr: str) -> None:
    warmup = args.warmup if args.warmup is not None else args.scrapes // 2
    warm = next(s for s in soak.samples if s[0] >= warmup)
    after = [s for s in soak.samples if s[0] >= warm[0]]
    last = soak.samples[-1]
    rss_growth = (last[2]["rss"] - warm[2]["rss"]) / 2**20
    rss_peak = (max(s[2]["rss"] for s in after) - warm[2]["rss"]) / 2**20
    fd_growth = last[2]["fds"] - warm[2]["fds"]
    thread_growth = last[2]["threads"] - warm[2]["threads"]
    checks = {
        "no errors": not soak.errors and not churn.failures and not engines.failures,
        "RSS growth after warm-up < 1 MiB": rss_growth < 1.0,
        "no fd growth (end <= warm-up + 2)": fd_growth <= 2,
        "no thread growth": thread_growth <= 0,
        "devices came and went under the exporter": soak.device_sets > 100 and churn.disappeared > 100,
    }
    if args.inference_processes:
        # Files of dead processes are deleted once folded: only the last few live ones may remain.
        checks["inference processes came and went; dead files removed"] = (
            engines.started > 100 and leftover <= args.inference_processes + 2)
    print(f"\n== soak: {soak.done} scrapes by {args.scrapers} scrapers in {elapsed:.0f} s "
          f"({soak.done / elapsed:.0f}/s) while loop devices came and went ==")
    print(f"loop devices created+attached {churn.appeared}, detached+deleted {churn.disappeared}; "
          f"scrapes that saw a different set of loop devices than the one before: {soak.device_sets} "
          f"(at most {soak.most_devices} at once)")
    print(f"inference processes started {engines.started} ({engines.killed} SIGKILLed), spool files left at the "
          f"end {leftover}; highest load counts seen: "
          f"{ {name.decode(): int(count) for name, count in sorted(soak.loads.items())} }")
    print(f"errors {sum(soak.errors.values())} {soak.errors or ''}; churn failures {len(churn.failures)} "
          f"{churn.failures[:3]} {engines.failures[:3] or ''}")
    print(f"{'scrapes':>8} {'seconds':>8} {'RSS MiB':>8} {'fds':>4} {'threads':>7}")
    step = max(1, len(soak.samples) // 20)
    for number, seconds, figures in soak.samples[::step] + ([] if (len(soak.samples) - 1) % step == 0
                                                              else [soak.samples[-1]]):
        print(f"{number:>8} {seconds:>8.0f} {figures['rss'] / 2**20:>8.2f} {figures['fds']:>4.0f} "
              f"{figures['threads']:>7.0f}")
    slope = slope_per_minute([(s[1], s[2]["rss"] / 1024) for s in after])
    print(f"after warm-up ({warm[0]} scrapes): RSS {warm[2]['rss'] / 2**20:.2f} -> {last[2]['rss'] / 2**20:.2f} MiB "
          f"(growth {rss_growth * 1024:+.0f} KiB, peak {rss_peak * 1024:+.0f} KiB, slope {slope:+.1f} KiB/min); "
          f"fds {warm[2]['fds']:.0f} -> {last[2]['fds']:.0f}; threads {warm[2]['threads']:.0f} -> "
          f"{last[2]['threads']:.0f}")
    half = next(s for s in soak.samples if s[0] >= (warm[0] + last[0]) // 2)
    print(f"RSS growth in the first half after warm-up ({warm[0]}-{half[0]}): "
          f"{(half[2]['rss'] - warm[2]['rss']) / 1024:+.0f} KiB; in the second ({half[0]}-{last[0]}): "
          f"{(last[2]['rss'] - half[2]['rss']) / 1024:+.0f} KiB (a leak grows in both; warm-up only in the first)")
    for name, ok in checks.items():
        print(f"{'PASS' if ok else 'FAIL'}  {name}")
    if stderr.strip():
        print("exporter log (warn and above):\n" + stderr[-3000:])
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"scrapes": soak.done, "seconds": elapsed, "errors": soak.errors, "checks": checks,
                       "appeared": churn.appeared, "disappeared": churn.disappeared,
                       "device_sets": soak.device_sets, "inference_processes": engines.started,
                       "samples": soak.samples}, handle, indent=1)
    if not all(checks.values()):
        raise SystemExit(1)


if __name__ == "__main__":
    main()
