"""Where gpuio-exporter's resident memory goes, against node_exporter's, measured in the same run.

1. Imports, cumulatively in the order the server loads them, each step in a fresh interpreter: the
   RSS after importing the step's modules (and the ones before), the difference from the step before,
   and the modules it added.  What the bare interpreter costs is the first row.
2. The real exporter (this checkout) after 200 scrapes of the scrape benchmark's fixture (10 disks,
   node_exporter's two collectors), then after one request that only FastAPI answers (an unknown path:
   FastAPI and pydantic are imported then), against node_exporter on the same fixture.  RSS from
   /proc/<pid>/status, and what /proc/<pid>/smaps_rollup says is anonymous (Python objects) against
   file-backed (shared libraries).

    .venv/bin/python bench/memory_bench.py
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import scrape_bench  # noqa: E402  (this directory's benchmark: its fixture and exporter launchers)

STEPS = [
    ("interpreter", []),
    ("asyncio, logging, ctypes, ssl", ["asyncio", "logging", "ctypes", "ssl"]),
    ("collectors and their parsers", ["exporter.assemble"]),
    ("uvicorn", ["uvicorn"]),
    ("uvloop, httptools", ["uvloop", "httptools", "uvicorn.protocols.http.httptools_impl"]),
    ("the server (its own modules)",
     ["exporter.cli", "exporter.web.server", "exporter.web.connections", "exporter.web.webconfig"]),
    ("FastAPI (only for what it alone answers)", ["fastapi", "fastapi.responses"]),
]

PROBE = r"""
import importlib, json, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
with open("/proc/self/status") as handle:
    rss = next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
print(json.dumps({"rss_kib": rss, "modules": sorted(sys.modules)}))
"""


def probe(modules: list[str]) -> dict[str, object]:
    output = subprocess.run([sys.executable, "-c", PROBE, *modules], check=True, capture_output=True, text=True,
                            env=scrape_bench.EXPORTER_ENV, cwd=scrape_bench.REPO).stdout
    return json.loads(output)  # type: ignore[no-any-return]


def report_imports() -> None:
    print("RSS after each import step, cumulative, each in a fresh interpreter")
    print(f"  {'step':<44}{'RSS MiB':>9}{'+MiB':>7}  modules added (top-level packages)")
    loaded: list[str] = []
    previous_rss, previous_modules = 0, set()
    for label, modules in STEPS:
        loaded += modules
        result = probe(loaded)
        rss, names = int(result["rss_kib"]), set(result["modules"])  # type: ignore[call-overload, arg-type]
        added = sorted({name.split(".")[0] for name in names - previous_modules if not name.startswith("_")})
        shown = ", ".join(added[:8]) + (f" (+{len(added) - 8})" if len(added) > 8 else "")
        print(f"  {label:<44}{rss / 1024:>9.1f}{(rss - previous_rss) / 1024 if previous_rss else 0:>7.1f}  {shown}")
        previous_rss, previous_modules = rss, names


def memory(pid: int) -> dict[str, float]:
    with open(f"/proc/{pid}/status") as handle:
        rss = next(int(line.split()[1]) for line in handle if line.startswith("VmRSS:"))
    rollup = {}
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            parts = line.split()
            if len(parts) == 3 and parts[2] == "kB":
                rollup[parts[0].rstrip(":")] = int(parts[1])
    return {"rss": rss / 1024, "anonymous": rollup.get("Anonymous", 0) / 1024,
            "file": (rss - rollup.get("Anonymous", 0)) / 1024}


def report_processes() -> None:
    print("\nprocesses after 200 scrapes (10 disks, diskstats and pressure), MiB")
    print(f"  {'':<46}{'RSS':>7}{'anonymous':>11}{'file-backed':>13}")
    with tempfile.TemporaryDirectory() as root:
        fixture = scrape_bench.Fixture(root, 10)
        ours, theirs = scrape_bench.gpuio(fixture), scrape_bench.node_exporter(fixture)
        for exporter in (ours, theirs):
            exporter.start()
        try:
            rows = []
            for exporter in (ours, theirs):
                scrape_bench.scrape_latencies(exporter, fixture, 150, {})
                assert exporter.process is not None
                rows.append((exporter.name, memory(exporter.process.pid)))
            with contextlib.suppress(urllib.error.HTTPError):  # a 404, from FastAPI, imported for it
                urllib.request.urlopen(f"http://127.0.0.1:{ours.port}/no-such-page", timeout=10)
            assert ours.process is not None
            rows.insert(1, ("gpuio-exporter after a request only FastAPI answers", memory(ours.process.pid)))
            for name, figures in rows:
                print(f"  {name:<46}{figures['rss']:>7.1f}{figures['anonymous']:>11.1f}{figures['file']:>13.1f}")
            print(f"  ratio gpuio-exporter / node_exporter: {rows[0][1]['rss'] / rows[2][1]['rss']:.2f}")
        finally:
            for exporter in (ours, theirs):
                exporter.stop()


def main() -> None:
    if scrape_bench.NODE_EXPORTER is None:
        sys.exit("prometheus-node-exporter is not installed (make system-deps)")
    print(f"python {sys.version.split()[0]}, node_exporter at {scrape_bench.NODE_EXPORTER}\n")
    report_imports()
    report_processes()


if __name__ == "__main__":
    main()
