"""Where one scrape's time goes, in process, at p50 and p99: the collectors on their worker threads
(with the hand-off to and from the event loop), rendering the text, rendering it gzipped; and whether
the slowest scrapes are the ones a garbage collection ran in.  Then the same collectors called
directly on one thread, one after the other: the difference is what the isolation's hand-off costs;
and how often the process's threads blocked (slept and were woken) per scrape in the collectors'
phase, which is what the hand-off is made of.

The fixture is the scrape benchmark's (N disks whose diskstats change before every scrape, PSI
files), the collectors are the same two (diskstats and pressure), and the garbage collector is frozen
after a warm-up, as the server does.  No HTTP: bench/scrape_bench.py measures that against node_exporter.

    .venv/bin/python bench/scrape_phases.py --devices 10 --scrapes 3000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)
sys.path.insert(0, HERE)

import scrape_bench  # noqa: E402  (this directory's benchmark: its fixture)

from exporter.assemble import build_scraper  # noqa: E402
from exporter.config import parse_args  # noqa: E402
from exporter.exposition import GzipRenderer, render  # noqa: E402

PHASES = ("collectors on threads, with the hand-off", "render text", "render gzipped", "all three")


def blocked_count() -> int:
    """How often this process's threads blocked (voluntary context switches, summed over its threads):
    each is a sleep and a wake-up, the hand-off's cost that wall-clock time on a busy machine blurs."""
    total = 0
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError), open(f"/proc/self/task/{task}/status") as status:
            total += sum(int(line.split()[1]) for line in status if line.startswith("voluntary_ctxt_switches"))
    return total


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))] * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--devices", type=int, default=10)
    parser.add_argument("--scrapes", type=int, default=3000)
    args = parser.parse_args()
    root = tempfile.mkdtemp(prefix="gpuio-bench-phases-")
    try:
        fixture = scrape_bench.Fixture(root, args.devices)
        config = parse_args(["--collector.disable-defaults", "--collector.diskstats", "--collector.pressure",
                             f"--path.procfs={fixture.proc}", f"--path.sysfs={fixture.sys}"])
        scraper = build_scraper(config)
        gzip = GzipRenderer(1)
        collections = [0]
        gc.callbacks.append(lambda phase, info: collections.__setitem__(0, collections[0] + (phase == "start")))

        blocked = [0]  # voluntary context switches during the scrapes' collector phase

        async def scrapes() -> list[tuple[float, ...]]:
            for _ in range(50):
                render(await scraper.scrape(None))
            gc.collect()
            gc.freeze()
            rows = []
            clock = time.perf_counter
            for _ in range(args.scrapes):
                fixture.tick()  # untimed
                before = collections[0]
                switches = blocked_count()
                start = clock()
                families = await scraper.scrape(None)
                collected = clock()
                blocked[0] += blocked_count() - switches  # untimed
                rendering = clock()
                render(families).encode()
                rendered = clock()
                gzip.compress(families, False)
                zipped = clock()
                rows.append((collected - start, rendered - rendering, zipped - rendered,
                             zipped - rendering + collected - start, collections[0] - before))
            return rows

        rows = asyncio.run(scrapes())
        direct = []
        collectors = [state.collector for state in scraper.states.values()]
        for _ in range(args.scrapes):
            fixture.tick()
            start = time.perf_counter()
            for collector in collectors:
                collector.collect()
            direct.append(time.perf_counter() - start)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"{args.devices} devices, {args.scrapes} scrapes in process (ms)")
    print(f"  {'':46s} {'p50':>7s} {'p99':>7s}")
    for index, name in enumerate(PHASES):
        times = [row[index] for row in rows]
        print(f"  {name:46s} {percentile(times, 0.5):7.3f} {percentile(times, 0.99):7.3f}")
    print(f"  {'the collectors called directly on one thread':46s} {percentile(direct, 0.5):7.3f} "
          f"{percentile(direct, 0.99):7.3f}")
    print(f"  threads blocked (sleep and wake-up) per scrape in the collectors' phase: {blocked[0] / len(rows):.2f}")
    slowest = sorted(rows, key=lambda row: row[3])[-max(1, len(rows) // 100):]
    print(f"  scrapes a garbage collection ran in: {sum(1 for row in rows if row[4])} of {len(rows)}; "
          f"of the slowest 1%: {sum(1 for row in slowest if row[4])} of {len(slowest)}")
    print(f"  the slowest 1% on average: collectors {statistics.mean(row[0] for row in slowest) * 1000:.2f} ms, "
          f"render {statistics.mean(row[1] for row in slowest) * 1000:.2f}, "
          f"gzipped {statistics.mean(row[2] for row in slowest) * 1000:.2f}")


if __name__ == "__main__":
    main()
