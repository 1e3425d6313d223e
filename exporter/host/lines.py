"""What every line parser raises for a line it cannot use: the parsers of /proc and sysfs files
(exporter/host/psi.py, cgroups.py, the collectors' own) share it, and import nothing of the collector framework."""

from __future__ import annotations


class BadLine(ValueError):
    """A source line a collector cannot use.  ``reason`` is one of the collector's own constants, never
    text from the line: it labels gpuio_scrape_collector_dropped_lines_total where the collector counts it."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason
