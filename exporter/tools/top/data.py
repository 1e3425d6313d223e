"""`gpuio top`'s data: the families it reads (from their declarations), snapshots of one scrape, and
the sources that take them (the exporter's own collectors in-process, or a running exporter's URL)."""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TextIO, cast

from gpuio.spool import SERIES

from ... import collect
from ...collectors import diskstats, engines, nvml, nvml_ledger, pressure, smart
from ..remote import DEFAULT_TIMEOUT, METRICS_PATH, ClientOptions, Exporter, RemoteError

# --- The families top reads, from their declarations in the collectors (never a copied literal). ---
# Disks (diskstats collector; node_exporter's node_disk_* semantics).
DISK_READS = diskstats.READS_COMPLETED.name
DISK_WRITES = diskstats.WRITES_COMPLETED.name
DISK_READ_BYTES = diskstats.READ_BYTES.name
DISK_WRITTEN_BYTES = diskstats.WRITTEN_BYTES.name
DISK_READ_TIME = diskstats.READ_TIME.name
DISK_WRITE_TIME = diskstats.WRITE_TIME.name
DISK_IO_TIME = diskstats.IO_TIME.name
DISK_IO_TIME_WEIGHTED = diskstats.IO_TIME_WEIGHTED.name
DISK_INFO = diskstats.INFO_DESC.name  # label rotational: "1", "0" or ""
DISK_PHYSICAL = diskstats.PHYSICAL_DESC.name  # labels device, physical_device
# Disk health (smart collector): 1 passed, 0 failed, labelled device.
SMART_HEALTH = smart.HEALTH.name
# IO pressure (pressure collector), counters of seconds.
PSI_IO_SOME = pressure.DESCS[("io", "some")].name
PSI_IO_FULL = pressure.DESCS[("io", "full")].name
PSI_MEMORY_SOME = pressure.DESCS[("memory", "some")].name
PSI_MEMORY_FULL = pressure.DESCS[("memory", "full")].name
PSI_CPU_SOME = pressure.DESCS[("cpu", "some")].name
# GPUs (nvml collector), every series labelled gpu (index) and uuid.
GPU_LABEL, GPU_UUID_LABEL = nvml.GPU  # "gpu" (NVML's index), "uuid"
GPU_INFO = nvml.INFO_DESC.name  # labels gpu, uuid, name, ...
GPU_UP = nvml.UP.name
GPU_BUSY = nvml.BUSY.name
GPU_SM_ACTIVE = nvml.SM_ACTIVE.name  # GPM (Hopper and newer): where present, "idle" is judged on it
GPU_MEMORY_USED = nvml.MEMORY_USED.name
GPU_MEMORY_TOTAL = nvml.MEMORY_TOTAL.name
GPU_TEMPERATURE = nvml.TEMPERATURE.name
GPU_POWER = nvml.POWER.name  # NVML's 1 s average (the energy counter is read only every 10 s)
# Age of the NVML sweep a scrape serves: GPU counters advance once per sweep, so their rates are taken
# over the sweeps' own interval (scrape time minus age), not the scrapes'.
GPU_AGE = nvml.AGE.name
GPU_THROTTLE = nvml.REASON.name  # one 0/1 series per reason
GPU_THROTTLE_REASON_LABEL = "reason"
# The GPU-time ledger: seconds of each GPU (by uuid, no gpu index) in each state; top shows the shares.
GPU_TIME = nvml_ledger.GPU_TIME.name
GPU_TIME_STATE_LABEL = "state"
GPU_TIME_STATES = nvml_ledger.STATES
# Clock-event reasons that are no slowdown (an idle GPU, clocks an operator or a display set): not listed.
# Of those listed, only thresholds.GPU_THROTTLE_REASONS flag a row (sw_power_cap is listed, not flagged).
GPU_THROTTLE_IGNORED = ("gpu_idle", "applications_clocks_setting", "display_clock_setting")
# Engines (engines collector), every series labelled engine.
ENGINE_LABEL = "engine"
ENGINE_INFO = engines.ENGINE_INFO.name  # labels engine, path, device, gpu_uuid (one series per file and GPU)
ENGINE_INFO_DEVICE_LABEL = "device"
ENGINE_INFO_GPU_LABEL = "gpu_uuid"
ENGINE_LATENCY = SERIES["inference_seconds"].name  # histogram (_bucket, _sum, _count)
ENGINE_IN_FLIGHT = engines.IN_FLIGHT.name
ENGINE_POOL_CONTEXTS = engines.POOL_CONTEXTS.name  # execution contexts: in flight at or above them queues
ENGINE_POOL_WAIT = SERIES["pool_wait_seconds"].name  # histogram
ENGINE_RESIDENCY = engines.FILE_RATIO.name  # per file (engine, path): the least cached is shown
ENGINE_PHYSICAL = engines.PHYSICAL_INFO.name  # labels engine, path, physical_device
# The exporter itself.
COLLECTOR_SUCCESS = collect.SUCCESS.name
# ---------------------------------------------------------------------------------------------------

log = logging.getLogger("gpuio.top")
MIB = 1024.0 * 1024.0  # iostat's "MB" in rMB/s is 2^20 bytes (sectors / 2048)
GIB = 1024.0**3
# The most of an exposition read, decompressed: a bound on what an answer can make top hold, not a size expected.
MAX_EXPOSITION_BYTES = 64 << 20
# ...and the most series, lines and labels in it, counted on the text before it is parsed: gzip packs 64 MiB of
# "a 1" lines (16 M series) into 64 KiB, and a series parsed costs ~200 bytes, a label ~180, twice over (top
# holds two scrapes).  A node serves a few thousand series (docs/performance.md: 2,422 with 8 GPUs, 20 engines
# and 24 disks), ~40,000 at the engines collector's caps (200 engines of up to 173 series), each with about 5
# labels (gpuio_disk_info has the most, 9).  A family's HELP and TYPE lines come on top of its series.  At these
# bounds top's peak RSS stays near 200 MiB (200,000 series) and 400 MiB (1,000,000 labels), measured.
MAX_EXPOSITION_SERIES = 200_000
MAX_EXPOSITION_LINES = 3 * MAX_EXPOSITION_SERIES
MAX_EXPOSITION_LABELS = 1_000_000
# Labels of one series: prometheus_client's parser copies the rest of the line for each label it reads, so a
# line of a million labels would take it hours.
MAX_SERIES_LABELS = 64
MAX_DETAIL_CHARS = 100  # of the parser's complaint, which quotes the line (a megabyte of it, where it is one)

Labels = dict[str, str]


class SourceError(Exception):
    """A snapshot could not be taken (exporter unreachable, bad answer); the message is for the screen."""


def gpu_key(labels: Labels) -> str | None:
    return labels.get(GPU_LABEL) or labels.get(GPU_UUID_LABEL)


@dataclass
class Snapshot:
    """Every sample of one scrape, by sample name, and when it was taken (a monotonic clock)."""

    at: float
    series: dict[str, list[tuple[Labels, float]]]

    def values(self, name: str, key: str, combine: Callable[[float, float], float] = operator.add) -> dict[str, float]:
        """``{labels[key]: value}``, the series of the other labels combined (summed by default)."""
        out: dict[str, float] = {}
        for labels, value in self.series.get(name, ()):
            if key in labels and not math.isnan(value):
                seen = out.get(labels[key])
                out[labels[key]] = value if seen is None else combine(seen, value)
        return out

    def per_gpu(self, name: str) -> dict[str, float]:
        """``{gpu: value}`` of a per-GPU family (the first series of each GPU)."""
        out: dict[str, float] = {}
        for labels, value in self.series.get(name, ()):
            key = gpu_key(labels)
            if key is not None and key not in out and not math.isnan(value):
                out[key] = value
        return out

    def scalar(self, name: str) -> float | None:
        found = self.series.get(name)
        return found[0][1] if found else None

    def labels(self, name: str) -> list[Labels]:
        return [labels for labels, _ in self.series.get(name, ())]


def parse_exposition(text: str | list[str]) -> dict[str, list[tuple[Labels, float]]]:
    """Every sample of a text exposition, by sample name: of ``text``, whole or split at its newlines.  The
    parser is given the lines, as it reads them from a file: the StringIO it would make of a whole text holds
    4 bytes a character."""
    from prometheus_client.parser import text_fd_to_metric_families

    lines = text.split("\n") if isinstance(text, str) else text
    series: dict[str, list[tuple[Labels, float]]] = {}
    for family in text_fd_to_metric_families(cast(TextIO, lines)):  # it only iterates over them
        for sample in family.samples:
            series.setdefault(sample.name, []).append((dict(sample.labels), float(sample.value)))
    return series


def bounded_lines(text: str, url: str) -> list[str]:
    """``text``'s lines, once it holds no more series, lines and labels than top reads (above); SourceError,
    one line, where it holds more.  Counted by str's C loops, so that nothing is made of an answer refused:
    series are the lines that are no comment (blank ones count too), labels the ``="`` that open a value."""
    lines = text.count("\n") + (not text.endswith("\n"))
    series = lines - text.count("\n#") - text.startswith("#")
    for what, count, bound, served in (("series", series, MAX_EXPOSITION_SERIES, "a few thousand, ~40,000 at its caps"),
                                       ("lines", lines, MAX_EXPOSITION_LINES, "a few thousand, ~40,000 at its caps"),
                                       ("labels", text.count('="'), MAX_EXPOSITION_LABELS,
                                        "~10,000, ~200,000 at its caps")):
        if count > bound:
            raise SourceError(f"{url}: the answer holds over {bound} {what} (an exporter serves {served}); is this a "
                              "gpuio exporter?")
    split = text.split("\n")
    if any(line.count('="') > MAX_SERIES_LABELS for line in split):
        raise SourceError(f"{url}: a series has over {MAX_SERIES_LABELS} labels; is this a gpuio exporter?")
    return split


class Source(Protocol):
    description: str

    def start(self) -> None: ...

    def sample(self) -> Snapshot: ...

    def close(self) -> None: ...


class LocalSource:
    """This machine, through the exporter's own collectors (its flags decide which, and where)."""

    def __init__(self, config: Any, clock: Callable[[], float] = time.monotonic) -> None:
        from ...assemble import build_scraper

        # process_* would describe this gpuio top process, not the node.
        self.scraper = build_scraper(dataclasses.replace(config, disable_exporter_metrics=True))
        self.clock = clock
        self.description = "this machine" if config.procfs == "/proc" else f"procfs {config.procfs}"

    def start(self) -> None:
        self.scraper.start()

    def sample(self) -> Snapshot:
        from ...exposition import render

        text = render(self.scraper.scrape_sync())
        return Snapshot(self.clock(), parse_exposition(text))

    def close(self) -> None:
        self.scraper.stop()


class UrlSource:
    """A running exporter's /metrics (text format; gzip accepted), reached with the TLS and basic auth
    ``options`` give (exporter/tools/remote.py)."""

    def __init__(self, url: str, clock: Callable[[], float] = time.monotonic, timeout: float = DEFAULT_TIMEOUT,
                 options: ClientOptions | None = None) -> None:
        self.exporter = Exporter(url, options or ClientOptions(timeout=timeout))
        self.headers = self.exporter.headers
        # The exporter's base or any of its endpoints: its /metrics, as `gpuio engines` reads its API.  The URL's
        # query goes along (?collect[]=diskstats reads those collectors only).
        self.url = self.exporter.endpoint(METRICS_PATH, self.exporter.query)
        self.clock = clock
        self.description = self.url  # without the password

    def start(self) -> None:
        pass

    def sample(self) -> Snapshot:
        try:
            body = self.exporter.get(self.url, MAX_EXPOSITION_BYTES, accept="text/plain;version=0.0.4", gzip=True)
        except RemoteError as exc:
            raise SourceError(str(exc)) from None
        text = body.decode("utf-8", errors="replace")
        del body  # copies of one answer are not held together: the body, its text, its lines
        lines = bounded_lines(text, self.url)
        del text
        try:
            return Snapshot(self.clock(), parse_exposition(lines))
        except ValueError as exc:
            detail = str(exc) if len(str(exc)) <= MAX_DETAIL_CHARS else str(exc)[:MAX_DETAIL_CHARS] + "..."
            raise SourceError(f"{self.url}: not a Prometheus text exposition ({detail})") from None

    def close(self) -> None:
        pass
