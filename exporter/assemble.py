"""Assembly of the scraper from a parsed configuration: the one place both entry points build it.

``gpuio-exporter`` serves what it builds over HTTP; ``gpuio scrape`` and ``gpuio top`` run it in
their own process.  Importing this module registers every collector (and so their flags), and it
imports nothing of the web stack.
"""

from __future__ import annotations

import platform

from . import __version__, collectors  # noqa: F401  (importing registers the collectors)
from .collect import REGISTRY, Collector, Scraper
from .config import Config
from .context import Context
from .exposition import label_string
from .process import ProcessMetrics


def build_labels() -> dict[str, str]:
    """The labels of gpuio_build_info."""
    return {"version": __version__, "python_version": platform.python_version()}


def build_scraper(config: Config) -> Scraper:
    """Instantiate the enabled collectors; a collector may reject its options with ConfigError."""
    context = Context(procfs=config.procfs, sysfs=config.sysfs, rootfs=config.rootfs)
    enabled: list[Collector] = [
        REGISTRY[name](context, config.collector_options[name])
        for name in sorted(REGISTRY)
        if config.enabled[name]
    ]
    exporter_metrics = None if config.disable_exporter_metrics else ProcessMetrics().families
    return Scraper(enabled, config.collector_timeout, label_string(build_labels()), exporter_metrics)
