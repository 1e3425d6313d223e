"""gpuio's recording rules and alerts, one module per source, all built from one ``Config``.

    pressure.py    IO pressure (PSI) and "the node stalls on IO"
    disk.py        block devices: rates, awaits, class limits, calm baselines; DiskIOStorm
    mounts.py      network and FUSE mounts; MountIOStorm
    gpu.py         GPU busy, stale GPU data; GPULost, GPUMissing, GPUThrottled, GPUPCIeLinkDegraded,
                   GPUXidError, GPUECCUncorrectable, GPUAllocatedIdle, GpuioGPUDataStale
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

import re
from typing import Any

from ..config import DEFAULT, Config
from . import disk, engines, exporter, gpu, mounts, pressure, smart, starvation
from .base import Rule

RECORDED = re.compile(r"\b[a-z_]+:[a-z0-9_]+:[a-z0-9_]+\b")  # a recording rule's name (level:metric:operations)


def rule_files(config: Config = DEFAULT) -> dict[str, dict[str, Any]]:
    """rules/<name>.yml -> its content.

    The storm and starvation alerts chain recording rules of several sources (disk -> mount -> engine on
    its GPU -> storm victims).  Rules of one group run in order at one timestamp, one after another on
    one core; groups run concurrently.  So the chain is cut where its links are costly and independent,
    into groups in the order they read each other (``evaluation_order``): what reads only raw series
    (the disk classes, the bucket rates), the judgements of now (``gpuio.inputs``: rates, awaits,
    saturation, GPU activity, the engine joins), the slow-moving calm normals (``gpuio.baselines``),
    and the storm, starvation and their alerts (``gpuio.starvation``).  A group reads the others'
    last results: in Prometheus each cut can add an evaluation to the first firing (a page reads
    ``gpuio.inputs`` through one cut); promtool's tests evaluate the groups in ``evaluation_order``
    at one timestamp (their ``group_eval_order``).  At 1,000 nodes no group takes more than a 15 s
    interval where the one chain took 70 s (docs/performance.md).
    """
    return {
        "starvation": {"groups": [
            {"name": "gpuio.disk.classes", "rules": disk.class_rules(config)},
            {"name": "gpuio.engines.latency.buckets", "rules": starvation.bucket_rules(config)},
            {"name": "gpuio.engines.latency", "rules": starvation.quantile_rules(config)},
            {"name": "gpuio.inputs", "rules": [
                *exporter.recording_rules(config), *pressure.recording_rules(config), *disk.recording_rules(config),
                *gpu.recording_rules(config), *mounts.recording_rules(config), *starvation.input_rules(config),
            ]},
            {"name": "gpuio.baselines", "rules": [*disk.baseline_rules(config), *starvation.baseline_rules(config)]},
            {"name": "gpuio.starvation", "rules": [
                *disk.storm_rules(config), *starvation.recording_rules(config),
                *disk.page_rules(config), *mounts.page_rules(config), *engines.load_slow_rules(config),
                *disk.alerts(config), *mounts.alerts(config), *starvation.alerts(config), gpu.data_stale_alert(config),
                engines.cold_start_alert(config),
            ]},
        ]},
        "gpu": {"groups": [
            {"name": "gpuio.gpu.alerts", "rules": gpu.alerts(config)},
            {"name": "gpuio.gpu.tickets", "interval": config.GPU_ALLOCATED_IDLE_EVAL_INTERVAL,
             "rules": gpu.tickets(config)},
        ]},
        "engines": {"groups": [
            {"name": "gpuio.engines.rules", "rules": engines.recording_rules(config)},
            {"name": "gpuio.engines.alerts", "rules": engines.alerts(config)},
        ]},
        "smart": {"groups": [
            {"name": "gpuio.smart.alerts", "rules": smart.alerts(config)},
        ]},
        "exporter": {"groups": [
            {"name": "gpuio.exporter.alerts", "rules": exporter.alerts(config)},
        ]},
    }


def group_reads(config: Config = DEFAULT) -> dict[str, set[str]]:
    """Each group's name -> the other groups whose recorded series it reads."""
    groups = [group for content in rule_files(config).values() for group in content["groups"]]
    owner = {rule["record"]: group["name"] for group in groups for rule in group["rules"] if "record" in rule}
    return {group["name"]: {owner[name] for rule in group["rules"] for name in RECORDED.findall(rule["expr"])
                            if name in owner} - {group["name"]} for group in groups}


def evaluation_order(config: Config = DEFAULT) -> list[str]:
    """Every group's name, each after the groups whose recorded series it reads (the files' order where
    nothing decides): the order promtool's tests evaluate them in, as Prometheus would with no delay."""
    reads = group_reads(config)
    order: list[str] = []
    while len(order) < len(reads):
        ready = [name for name in reads if name not in order and reads[name] <= set(order)]
        if not ready:
            raise ValueError(f"rule groups read each other in a cycle: {sorted(set(reads) - set(order))}")
        order.append(ready[0])
    return order


def alerts(config: Config = DEFAULT) -> list[Rule]:
    return [rule for content in rule_files(config).values() for group in content["groups"]
            for rule in group["rules"] if "alert" in rule]
