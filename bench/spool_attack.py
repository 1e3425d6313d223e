"""A hostile spool writer against a real exporter process: what it costs and what it can hide.

Starts ``python -m exporter`` from a source tree (``--tree``, default this checkout: run it once with
an older checkout for "before" figures) on a spool directory that this script fills the way a
hostile writer would, scrapes it over HTTP, and prints one line per attack:

  memory    three live files (this script holds their flocks) whose sparse 1 GiB (``--claim-gib``)
            is all "used": the exporter's RSS (VmRSS, and its peak VmHWM), scrape time, engines success
  paths     a live writer names /etc/shadow, /dev/ptmx and a FIFO with their real device and inode:
            how many of them get gpuio_engine_file_size_bytes
  names     3,000 live writers each with an engine of its own name, then a real engine that serves:
            is the real one exported, and how many engines are
  infos     3,000 live writers of one engine, each naming another path: gpuio_engine_info series
  folded    a real engine (123,456,789 bytes loaded) exits, 1,000 dead junk engines follow, then a new
            process of the real engine loads 1,000 bytes: the engine's load_read_bytes_total
  garbage   20,000 garbage files: spool_errors_total over five scrapes

    sudo .venv/bin/python bench/spool_attack.py                          # this checkout
    sudo .venv/bin/python bench/spool_attack.py --tree /tmp/old-checkout # the same against another
    sudo .venv/bin/python bench/spool_attack.py --only memory,paths

Root: /etc/shadow and /dev/ptmx are what an exporter running as root would open.  The spool files
are made with this checkout's library (the format is the same in both trees).  The spool directory
is on /dev/shm (tmpfs: sparse files cost nothing).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
LIBRARY = os.path.join(REPO, "exporter", "instrument")  # gpuio, the instrumentation library, from this checkout
sys.path.insert(0, LIBRARY)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (LIBRARY, os.environ.get("PYTHONPATH"))))

from gpuio import spool as spool_format  # noqa: E402
from gpuio.metrics import EngineMetrics  # noqa: E402
from tests.conftest import free_port, parse_samples, root  # noqa: E402

PROC, SYS = root("linux-6.8")
GIB = 1 << 30


@contextlib.contextmanager
def exporter(tree: str, spool: str, *extra: str) -> Iterator[Callable[[], tuple[str, float]]]:
    port = free_port()
    command = [sys.executable, "-m", "exporter", f"--web.listen-address=127.0.0.1:{port}", f"--path.procfs={PROC}",
               f"--path.sysfs={SYS}", f"--collector.engines.spool-dir={spool}", "--no-collector.smart",
               "--no-collector.nvml", "--collector.engines.residency-interval=200ms", *extra]
    process = subprocess.Popen(command, cwd=tree, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})

    def scrape() -> tuple[str, float]:
        start = time.perf_counter()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=60) as response:
            text = response.read().decode()
        return text, time.perf_counter() - start

    deadline = time.monotonic() + 30
    while True:
        try:
            scrape()
            break
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "exporter did not start"
            time.sleep(0.1)
    scrape.pid = process.pid  # type: ignore[attr-defined]
    try:
        yield scrape
    finally:
        process.terminate()
        process.wait(timeout=15)


def rss(pid: int) -> tuple[float, float]:
    """(VmRSS, VmHWM) in MB."""
    with open(f"/proc/{pid}/status") as handle:
        fields = dict(line.split(":", 1) for line in handle)
    return int(fields["VmRSS"].split()[0]) / 1024, int(fields["VmHWM"].split()[0]) / 1024


def engines_success(text: str) -> float:
    return parse_samples(text).get(("gpuio_scrape_collector_success", frozenset({("collector", "engines")})), -1)


def writer(spool: str, engine: str | None = None, size: int = 8192) -> spool_format.SpoolFile:
    file = spool_format.SpoolFile(spool, size)
    if engine is not None:
        EngineMetrics(engine, file).load_read_bytes.inc(1)
    return file


def attack_memory(tree: str, spool: str, args: argparse.Namespace) -> str:
    files = [writer(spool, size=args.claim_gib * GIB) for _ in range(3)]
    for file in files:
        struct.pack_into("<Q", file._map, spool_format.USED_OFFSET, args.claim_gib * GIB)
    real = writer(spool, "resnet50")
    with exporter(tree, spool) as scrape:
        before = rss(scrape.pid)[0]  # type: ignore[attr-defined]
        times, success = [], []
        for _ in range(5):
            text, seconds = scrape()
            times.append(seconds)
            success.append(engines_success(text))
        now, peak = rss(scrape.pid)  # type: ignore[attr-defined]
    for file in [*files, real]:
        file.close()
    return (f"memory   3 x {args.claim_gib} GiB claimed: RSS {now:.0f} MB (peak {peak:.0f} MB; {before:.0f} MB "
            f"after the first scrape), scrape p50 {statistics.median(times) * 1000:.0f} ms "
            f"max {max(times) * 1000:.0f} ms, engines success {success}")


def attack_paths(tree: str, spool: str, args: argparse.Namespace) -> str:
    fifo = os.path.join(tempfile.mkdtemp(dir="/dev/shm"), "fifo.engine")
    os.mkfifo(fifo)
    file = writer(spool)
    for engine, path in (("shadow", "/etc/shadow"), ("ptmx", "/dev/ptmx"), ("fifo", fifo)):
        st = os.stat(path)
        EngineMetrics(engine, file)._append_info(spool_format.pack_info(
            0, (os.major(st.st_dev), os.minor(st.st_dev)), st.st_ino, st.st_size, 0, 1.0, path, "", "x"))
    with exporter(tree, spool, f"--collector.engines.path-include=/etc,/dev,{os.path.dirname(fifo)}"
                  if args.include_hostile else "--log.level=warn") as scrape:
        scrape()
        time.sleep(1.0)  # two residency scans
        text, _ = scrape()
    file.close()
    shutil.rmtree(os.path.dirname(fifo))
    sized = sorted(dict(labels)["engine"] for name, labels in parse_samples(text)
                   if name == "gpuio_engine_file_size_bytes")
    return f"paths    hostile paths published with a size: {len(sized)} of 3 {sized}"


def attack_names(tree: str, spool: str, args: argparse.Namespace) -> str:
    junk = [writer(spool, f"junk-{index:04d}") for index in range(3000)]
    with exporter(tree, spool) as scrape:
        scrape()
        real = writer(spool)
        metrics = EngineMetrics("resnet50", real)
        for _ in range(4):
            metrics.inference_seconds.observe(0.01)
            text, seconds = scrape()
        exported = {dict(labels)["engine"] for name, labels in parse_samples(text) if name == "gpuio_engine_processes"}
    for file in [*junk, real]:
        file.close()
    return (f"names    3,000 junk names, then a real engine: exported {len(exported)}, the real one "
            f"{'IN' if 'resnet50' in exported else 'LEFT OUT'} (last scrape {seconds * 1000:.0f} ms)")


def attack_infos(tree: str, spool: str, args: argparse.Namespace) -> str:
    files = []
    for index in range(3000):
        file = writer(spool)
        EngineMetrics("resnet50", file)._append_info(spool_format.pack_info(0, (0, 0), 0, 0, 0, float(index),
                                                                   f"/models/copy-{index}.engine", "", "x"))
        files.append(file)
    with exporter(tree, spool) as scrape:
        for _ in range(3):
            text, _ = scrape()
    for file in files:
        file.close()
    infos = sum(1 for name, _ in parse_samples(text) if name == "gpuio_engine_info")
    return f"infos    3,000 paths for one engine: gpuio_engine_info series {infos}"


def attack_folded(tree: str, spool: str, args: argparse.Namespace) -> str:
    real = writer(spool)
    EngineMetrics("resnet50", real).load_read_bytes.inc(123_456_789)
    key = ("gpuio_engine_load_read_bytes_total", frozenset({("engine", "resnet50")}))
    with exporter(tree, spool) as scrape:
        first = parse_samples(scrape()[0])[key]
        real.close()
        scrape()
        for index in range(1000):
            writer(spool, f"junk-{index:04d}").close()
        later = writer(spool)
        EngineMetrics("resnet50", later).load_read_bytes.inc(1000)
        texts = [scrape()[0] for _ in range(3)]
    later.close()
    values = [parse_samples(text).get(key) for text in texts]
    return (f"folded   load_read_bytes_total{{engine=resnet50}}: {first:.0f} before the junk, then {values}, "
            f"engines success {[engines_success(text) for text in texts]}")


def attack_garbage(tree: str, spool: str, args: argparse.Namespace) -> str:
    for index in range(20_000):
        with open(os.path.join(spool, f"gpuio-{index}-1-garbage.spool"), "wb") as handle:
            handle.write(b"garbage " * 40)
    key = "gpuio_engine_spool_errors_total"
    totals, times, success = [], [], []
    with exporter(tree, spool) as scrape:
        for _ in range(6):
            text, seconds = scrape()
            times.append(seconds)
            success.append(engines_success(text))
            totals.append(sum(value for (name, _), value in parse_samples(text).items() if name == key))
    return (f"garbage  20,000 garbage files: spool_errors_total over 6 scrapes {[int(t) for t in totals]}, "
            f"scrape times {[round(t * 1000) for t in times]} ms, engines success {success}")


ATTACKS = {"memory": attack_memory, "paths": attack_paths, "names": attack_names, "infos": attack_infos,
           "folded": attack_folded, "garbage": attack_garbage}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", default=REPO, help="source tree whose exporter to run (default: this checkout)")
    parser.add_argument("--only", default=",".join(ATTACKS), help="comma-separated attacks")
    parser.add_argument("--claim-gib", type=int, default=1, help="GiB each sparse file claims (memory)")
    parser.add_argument("--include-hostile", action="store_true",
                        help="paths: also allow /etc and /dev in --collector.engines.path-include")
    args = parser.parse_args()
    print(f"tree {args.tree}")
    for name in args.only.split(","):
        spool = tempfile.mkdtemp(prefix="gpuio-attack-", dir="/dev/shm")
        try:
            print(ATTACKS[name](args.tree, spool, args), flush=True)
        finally:
            shutil.rmtree(spool)


if __name__ == "__main__":
    main()
