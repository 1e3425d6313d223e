"""gpuio's recording rules and alerts, one module per source, all built from one ``Config``.

    pressure.py    IO pressure (PSI) and "the node stalls on IO"
    disk.py        block devices: rates, awaits, class limits, calm baselines; DiskIOStorm
    mounts.py      network and FUSE mounts; MountIOStorm
    gpu.py         GPU busy, stale GPU data; GPULost, GPUMissing, GPUThrottled, GPUPCIeLinkDegraded,
                   GPUXidError, GPUECCUncorrectable, GpuioGPUDataStale
    starvation.py  engine -> GPU -> storage joins, work waiting; GPUStarvedByDiskIO, NodeGPUStarvedByIO
    engines.py     engine loads, the spool; EngineColdStartSlow, GpuioEngineSpoolErrors
    smart.py       disk health; DiskHealthDegrading, GpuioSmartDataStale
    exporter.py    the exporter itself: its data unbroken (scrape gaps); GpuioExporterDown, GpuioCollectorFailing

    names.py       recording-rule names (they carry the config's windows) and shared joins
    base.py        record(), alert() - the one way to write an alert: severity, runbook, dashboard link
    templates.py   alert-description snippets that print live figures

``rule_files(config)`` lays them out in rules/<name>.yml; ``python -m deploy.generate`` writes them.
Rules in a group run in order at one timestamp, so a rule may use the ones above it.
"""

from __future__ import annotations

from typing import Any

from ..config import DEFAULT, Config
from . import disk, engines, exporter, gpu, mounts, pressure, smart, starvation
from .base import Rule


def rule_files(c: Config = DEFAULT) -> dict[str, dict[str, Any]]:
    """rules/<name>.yml -> its content.

    gpuio.starvation is ONE group on purpose: the storm and starvation alerts chain recording rules of
    several sources (disk -> mount -> engine on its GPU -> storm victims), and only rules of one group
    run in a fixed order at one timestamp.  Split over groups, each link could see the previous
    evaluation of the one before (Prometheus runs groups independently): first firing would wobble by
    an evaluation per link, and promtool's tests with it.  What reads only raw series and costs most at
    fleet scale (the disk classes, the latency quantiles) is a group of its own before it: it runs
    beside the chain, which reads its last result (one evaluation old at most).
    """
    return {
        "starvation": {"groups": [
            {"name": "gpuio.disk.classes", "rules": disk.class_rules(c)},
            {"name": "gpuio.engines.latency", "rules": starvation.quantile_rules(c)},
            {"name": "gpuio.starvation", "rules": [
                *exporter.recording_rules(c), *pressure.recording_rules(c), *disk.recording_rules(c),
                *gpu.recording_rules(c), *mounts.recording_rules(c), *starvation.recording_rules(c),
                *disk.page_rules(c), *mounts.page_rules(c), *engines.load_slow_rules(c),
                *disk.alerts(c), *mounts.alerts(c), *starvation.alerts(c), gpu.data_stale_alert(c),
                engines.cold_start_alert(c),
            ]},
        ]},
        "gpu": {"groups": [
            {"name": "gpuio.gpu.alerts", "rules": gpu.alerts(c)},
        ]},
        "engines": {"groups": [
            {"name": "gpuio.engines.rules", "rules": engines.recording_rules(c)},
            {"name": "gpuio.engines.alerts", "rules": engines.alerts(c)},
        ]},
        "smart": {"groups": [
            {"name": "gpuio.smart.alerts", "rules": smart.alerts(c)},
        ]},
        "exporter": {"groups": [
            {"name": "gpuio.exporter.alerts", "rules": exporter.alerts(c)},
        ]},
    }


def alerts(c: Config = DEFAULT) -> list[Rule]:
    return [rule for content in rule_files(c).values() for group in content["groups"]
            for rule in group["rules"] if "alert" in rule]
