"""Pressure stall information from /proc/pressure (Documentation/accounting/psi.rst).

``total`` is cumulative stall time in microseconds; exported as seconds with node_exporter's exact
arithmetic (``total / 1000.0 / 1000.0``), so ``gpuio_pressure_*`` equals ``node_pressure_*``.
"some" is time in which at least one task waited, "full" time in which all non-idle tasks did.

No /proc/pressure (a kernel before 4.20 or without CONFIG_PSI) or PSI turned off (``psi=0``: reads
fail with EOPNOTSUPP) is "no data here", not a failure.  irq appears from 6.1
(CONFIG_IRQ_TIME_ACCOUNTING) and is exported where the kernel writes it.  The system-wide cpu "full"
line that kernels print since 5.13 is left out: psi.rst says it is undefined at the system level and
always zero there, kept only for the file's format.
"""

from __future__ import annotations

import errno
import logging
import os

from ..collect import Absent, Collector, MalformedSource, register
from ..exposition import COUNTER, Desc, Family
from ..host.lines import BadLine
from ..host.psi import parse_total
from ..logsetup import LogOnce

log = logging.getLogger("gpuio.collector.pressure")

# (resource, line kind) -> the family it feeds.
DESCS: dict[tuple[str, str], Desc] = {
    ("cpu", "some"): Desc("gpuio_pressure_cpu_waiting_seconds_total", COUNTER,
                          "Total time in seconds that processes have waited for CPU time.", unit="seconds"),
    ("io", "some"): Desc("gpuio_pressure_io_waiting_seconds_total", COUNTER,
                         "Total time in seconds that processes have waited due to IO congestion.", unit="seconds"),
    ("io", "full"): Desc("gpuio_pressure_io_stalled_seconds_total", COUNTER,
                         "Total time in seconds no process could make progress due to IO congestion.", unit="seconds"),
    ("memory", "some"): Desc("gpuio_pressure_memory_waiting_seconds_total", COUNTER,
                             "Total time in seconds that processes have waited for memory.", unit="seconds"),
    ("memory", "full"): Desc("gpuio_pressure_memory_stalled_seconds_total", COUNTER,
                             "Total time in seconds no process could make progress due to memory congestion.",
                             unit="seconds"),
    ("irq", "full"): Desc("gpuio_pressure_irq_stalled_seconds_total", COUNTER,
                          "Total time in seconds no process could make progress due to IRQ/softirq work.",
                          unit="seconds"),
}
RESOURCES = ("cpu", "io", "memory", "irq")


@register
class PressureCollector(Collector):
    """One family per (resource, kind) line.  Each file the kernel writes holds at least one good line,
    so a file with none (garbage, or empty) fails the collector (node_exporter 1.5 fails too); a bad line
    beside good ones is skipped and counted in gpuio_scrape_collector_dropped_lines_total."""

    name = "pressure"

    def __init__(self, context, options) -> None:  # type: ignore[no-untyped-def]
        super().__init__(context, options)
        self._directory = os.path.join(context.procfs, "pressure")
        self._bad_lines = LogOnce(log)

    def collect(self) -> list[Family]:
        if not os.path.isdir(self._directory):
            raise Absent(f"{self._directory} does not exist: a kernel without PSI (CONFIG_PSI, or psi=0)")
        families: list[Family] = []
        unreadable: list[str] = []
        read_any = False
        for resource in RESOURCES:
            text = self._read(resource)
            if text is None:
                continue
            read_any = True
            found, good = self._parse(resource, text)
            families.extend(found)
            if not good:
                unreadable.append(f"pressure/{resource}")
        if unreadable:  # the other files' values are still served
            raise MalformedSource(f"no valid PSI line in {', '.join(unreadable)}", families)
        if not families and not read_any:
            raise Absent(f"no file under {self._directory} can be read: PSI is off (psi=0 on the kernel "
                         "command line)")
        return families

    def _parse(self, resource: str, text: str) -> tuple[list[Family], int]:
        """The families of one resource's file, and how many of its lines were good."""
        families = []
        source = f"pressure/{resource}"
        seen: set[str] = set()  # a second "some" line (no kernel writes one) must not repeat a family
        for line in text.splitlines():
            if not line.strip():
                continue
            try:
                kind, total = parse_total(line)
            except BadLine as exc:
                self.dropped_lines.add(source, exc.reason)
                self._bad_lines.warning("skipping bad pressure line", line.strip(), resource=resource,
                                        reason=str(exc))
                continue
            if kind in seen:
                self.dropped_lines.add(source, "repeated")
                self._bad_lines.warning("skipping repeated pressure line", line.strip(), resource=resource)
                continue
            seen.add(kind)
            desc = DESCS.get((resource, kind))
            if desc is not None:
                families.append(Family(desc, [desc.sample("", total / 1000.0 / 1000.0)]))
        return families, len(seen)

    def _read(self, resource: str) -> str | None:
        try:
            with open(os.path.join(self._directory, resource), encoding="ascii", errors="replace") as handle:
                return handle.read()
        except FileNotFoundError:
            return None  # irq before 6.1, or a resource this kernel does not account
        except OSError as exc:
            if exc.errno == errno.EOPNOTSUPP:
                return None  # psi=0 on the kernel command line
            raise
