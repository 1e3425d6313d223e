"""What the smart collector costs: the time 24 cached disks add to a scrape, and the poll time per disk.

A scrape never runs smartctl; it serves the families the last background sweep rendered. So the scrape
cost is measured as the server pays it, in-process: ``Scraper.scrape`` (the thread hand-off, the
collectors, the self-metrics), ``render`` and ``encode``, or with gzip at level 1 as Prometheus asks for
it, through the server's GzipRenderer (the smart families' gzip member is made once per sweep). The
peer, measured in the same run on the same fixture tree, is the same exporter without the smart
collector (diskstats and pressure on tests/fixtures/roots/linux-6.8); the difference of the medians is
what the disks add. Each scrape is timed on its own, the variants interleaved in rotating order. One
more variant gzips the whole body on every scrape, as the server did before GzipRenderer.

The 24 disks are replayed by the fake smartctl of tests/fixtures/smartctl from real recordings:
16 SATA HDDs (sat_hdd_0_issue70, 22 ATA attributes each: the largest output per disk) and 8 NVMe
(nvme_0).  The poll time per disk printed is the sweep that filled the cache; through the fake it is
mostly a Python start-up per smartctl run, so ``--real`` polls this machine's own disks with the real
smartctl instead (run it as root on a node with disks; no scrape figures then).

    .venv/bin/python bench/smart_bench.py                 # --scrapes 3000 --disks 24
    sudo .venv/bin/python bench/smart_bench.py --real     # poll time of this machine's disks
"""

from __future__ import annotations

import argparse
import asyncio
import gzip
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
# gpuio, the instrumentation library, from this checkout
LIBRARY = os.path.join(os.path.dirname(HERE), "exporter", "instrument")
sys.path.insert(0, LIBRARY)
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, (LIBRARY, os.environ.get("PYTHONPATH"))))

import exporter.collectors.smart  # noqa: E402,F401  (registers the collector)
from exporter.collect import Scraper  # noqa: E402
from exporter.collectors import diskstats, pressure  # noqa: E402
from exporter.collectors.smart import SmartCollector  # noqa: E402
from exporter.config import parse_args  # noqa: E402
from exporter.context import Context  # noqa: E402
from exporter.exposition import GzipRenderer, render  # noqa: E402
from tests.conftest import root  # noqa: E402
from tests.fixtures.smartctl.fake import SINGLE, FakeSmartctl  # noqa: E402

GZIP_LEVEL = 1  # exporter/web/server.py


def build_host(directory: str, disks: int) -> tuple[FakeSmartctl, str]:
    """A fake host with ``disks`` disks (two thirds SATA, one third NVMe) and a sysfs naming the namespaces."""
    data = os.path.join(directory, "disks")
    sysfs = os.path.join(directory, "sys")
    os.makedirs(data)
    scan = []
    nvme = disks // 3
    for index in range(disks):
        if index < nvme:
            name, kind, case = f"nvme{index}", "nvme", "nvme_0/_-d_nvme_--all__dev_nvme0"
            os.makedirs(os.path.join(sysfs, "class", "nvme", name, f"{name}n1"))
            scan.append(f"/dev/{name} -d nvme # /dev/{name}, NVMe device")
        else:
            n = index - nvme
            name = "sd" + (chr(96 + n // 26) if n >= 26 else "") + chr(97 + n % 26)
            kind, case = "sat", "sat_hdd_0_issue70/_-d_sat_--all__dev_sg2"
            scan.append(f"/dev/{name} -d sat # /dev/{name} [SAT], ATA device")
        os.symlink(os.path.join(SINGLE, case), os.path.join(data, f"_-d_{kind}_--all__dev_{name}"))
    return FakeSmartctl(os.path.join(directory, "fake"), [data], scan=scan), sysfs


def smart_collector(sysfs: str, smartctl: str) -> SmartCollector:
    options = parse_args([f"--smartctl.path={smartctl}"], environ={}).collector_options["smart"]
    return SmartCollector(Context(sysfs=sysfs), options)


def print_polls(smart: SmartCollector, sweep_seconds: float) -> None:
    print(f"{'device':>12} {'smartctl device':>16} {'type':>6} {'state':>12} {'poll ms':>8}")
    for target, record in smart._records.items():
        print(f"{','.join(target.devices):>12} {target.path:>16} {target.kind or '':>6} {record.state:>12} "
              f"{record.seconds * 1000:8.1f}")
    polls = [record.seconds for record in smart._records.values()]
    if polls:
        print(f"poll per disk: median {statistics.median(polls) * 1000:.1f} ms, max {max(polls) * 1000:.1f} ms; "
              f"whole sweep {sweep_seconds * 1000:.0f} ms ({len(polls)} disks, "
              f"{smart._concurrency} at a time)")
    else:
        print("no disks found")


Variant = Callable[[], Awaitable[bytes]]


def plain(scraper: Scraper, compress: bool) -> Variant:
    """A scrape rendered and encoded, the whole body gzipped when asked (what the server did before)."""
    async def run() -> bytes:
        body = render(await scraper.scrape()).encode()
        return gzip.compress(body, GZIP_LEVEL) if compress else body
    return run


def server_gzip(scraper: Scraper) -> Variant:
    """What the server does: GzipRenderer, the smart families' member compressed once per sweep."""
    renderer = GzipRenderer(GZIP_LEVEL)

    async def run() -> bytes:
        return renderer.compress(await scraper.scrape())
    return run


def time_variants(variants: dict[str, Variant], count: int) -> dict[str, list[float]]:
    """Seconds per scrape of each variant, interleaved (rotating order) so all see the same machine state."""
    times: dict[str, list[float]] = {name: [] for name in variants}

    async def run() -> None:
        names = list(variants)
        for index in range(count):
            for name in names[index % len(names):] + names[: index % len(names)]:
                started = time.perf_counter()
                await variants[name]()
                times[name].append(time.perf_counter() - started)

    asyncio.run(run())
    return times


def report(times: dict[str, list[float]], baseline: str, disks: int) -> None:
    p50 = {name: statistics.median(values) * 1000 for name, values in times.items()}
    for name, values in times.items():
        p99 = statistics.quantiles(values, n=100)[98] * 1000
        added = "" if name == baseline else f"; {disks} cached disks add {p50[name] - p50[baseline]:.3f} ms"
        print(f"  {name:>34}: p50 {p50[name]:.3f} ms (p99 {p99:.3f}){added}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scrapes", type=int, default=3000)
    parser.add_argument("--disks", type=int, default=24)
    parser.add_argument("--real", action="store_true", help="poll this machine's disks with the real smartctl")
    args = parser.parse_args()
    if args.real:
        smartctl = shutil.which("smartctl") or shutil.which("smartctl", path="/usr/sbin:/sbin")
        if smartctl is None:
            raise SystemExit("smartctl is not installed")
        smart = smart_collector("/sys", smartctl)
        started = time.perf_counter()
        smart.sampler.sample_now()
        print_polls(smart, time.perf_counter() - started)
        return

    with tempfile.TemporaryDirectory() as directory:
        fake, sysfs = build_host(directory, args.disks)
        smart = smart_collector(sysfs, fake.path)
        started = time.perf_counter()
        smart.sampler.sample_now()
        sweep_seconds = time.perf_counter() - started
        print(f"== poll time per disk (fake smartctl: {len(fake.calls())} runs, each a Python start-up)")
        print_polls(smart, sweep_seconds)

        procfs, tree_sysfs = root("linux-6.8")
        context = Context(procfs=procfs, sysfs=tree_sysfs)
        base = [diskstats.DiskstatsCollector(context, {}), pressure.PressureCollector(context, {})]
        scrapers = {"without smart": Scraper(base, 2.0, ""), "with smart": Scraper([*base, smart], 2.0, "")}
        smart_lines = sum(len(family.samples) for family in smart.collect())
        collect = []
        for _ in range(args.scrapes):
            started = time.perf_counter()
            smart.collect()
            collect.append(time.perf_counter() - started)
        print(f"\n== scrape cost, {args.scrapes} scrapes each, in ms; smart adds {smart_lines} sample lines")
        print(f"smart collect() alone: {statistics.median(collect) * 1e6:.2f} us")
        without, with_smart = scrapers["without smart"], scrapers["with smart"]
        print("text:")
        report(time_variants({"without smart": plain(without, False), "with smart": plain(with_smart, False)},
                             args.scrapes), "without smart", args.disks)
        print("text + gzip level 1 (what Prometheus asks for), as the server compresses it:")
        variants = {"without smart": server_gzip(without), "with smart": server_gzip(with_smart),
                    "with smart, whole body gzipped": plain(with_smart, True)}
        body = gzip.decompress(asyncio.run(variants["with smart"]())).decode()  # several members, one stream
        assert body.count("gpuio_smart_") >= smart_lines and body.endswith("\n")
        report(time_variants(variants, args.scrapes), "without smart", args.disks)

if __name__ == "__main__":
    main()
