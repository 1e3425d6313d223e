"""What one read of the spool costs when a writer fills the directory with names.

Makes a directory (on tmpfs where there is one) holding 3 live writers' files and N junk names, and
times SpoolReader.read() 20 times: a read looks at 65,536 entries at most and the next one goes on from
there, so the time of a read does not grow with N; the reads a whole walk of the directory takes do.

    .venv/bin/python bench/spool_listing_bench.py                   # 200,000 and 1,000,000 names
    .venv/bin/python bench/spool_listing_bench.py --names 5000000
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from exporter.engines import spool as spool_source  # noqa: E402
from gpuio import spool as spool_format  # noqa: E402
from gpuio.metrics import EngineMetrics  # noqa: E402


def one(count: int) -> None:
    directory = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        writers = [spool_format.SpoolFile(directory) for _ in range(3)]
        for file in writers:
            EngineMetrics("engine", file).inference_seconds.observe(0.01)
        for index in range(count):
            os.close(os.open(os.path.join(directory, f"junk-{index:07d}"), os.O_CREAT | os.O_WRONLY, 0o644))
        reader = spool_source.SpoolReader(directory)
        times, walked = [], 0
        for _ in range(20):
            started = time.perf_counter()
            totals = reader.read()
            times.append((time.perf_counter() - started) * 1e3)
            walked += not totals.unfinished_listings
        times.sort()
        print(f"{count:>9,} names: read() p50 {statistics.median(times):6.1f} ms, max {times[-1]:6.1f} ms; "
              f"{-(-(count + 3) // reader.scan_entries)} reads a walk; walks finished in 20 reads: {walked}; "
              f"live files {totals.live_files}")
        for file in writers:
            file.close()
    finally:
        shutil.rmtree(directory)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--names", type=int, action="append", help="junk names (default: 200,000 and 1,000,000)")
    args = parser.parse_args()
    for count in args.names or [200_000, 1_000_000]:
        one(count)


if __name__ == "__main__":
    main()
