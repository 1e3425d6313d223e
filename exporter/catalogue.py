"""Every metric family the exporter serves, in one list: the declarations, gathered.

Each family is declared once, beside the code that produces it, as a module-level
:class:`~exporter.exposition.Desc` (full name, type, unit, label names, help) in one of the modules
that :data:`SECTIONS` names; the engines' spool series are declared in the instrumentation library
(``gpuio.spool.ENGINE_SERIES``) and become Descs in exporter/collectors/engines.py.  This module finds
them there (nothing is listed twice), refuses two declarations of one name, and renders the reference
users read, docs/metrics.md::

    python -m exporter.catalogue --write docs/metrics.md   # regenerate the reference
    python -m exporter.catalogue --check docs/metrics.md   # exit 1 if it is stale

Consumers (``gpuio top``, the rules, the dashboards, the tests) take names from the declarations or
from :func:`by_name`, never from a copied string.  It imports the collectors and the exporter's own
families only: no web stack (FastAPI, uvicorn, bcrypt, YAML).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType

from . import collect, process
from .collectors import cgroup_io, diskstats, engines, mountstats, nvml, nvml_ledger, pods, pressure, smart
from .exposition import INFO, Desc
from .web import server_metrics


@dataclass(frozen=True)
class Section:
    """A part of the reference: the families of some modules (``only`` picks some of them) and the prose
    that introduces them."""

    title: str
    modules: tuple[ModuleType, ...]
    intro: str = ""
    only: Callable[[Desc], bool] | None = None


def declared_in(module: ModuleType) -> Iterator[Desc]:
    """The families ``module`` declares at its top level, alone or in tuples, lists and dicts, in the
    order of the module's names."""
    for value in vars(module).values():
        yield from _descs(value, depth=3)


def _descs(value: object, depth: int) -> Iterator[Desc]:
    if isinstance(value, Desc):
        yield value
    elif depth and isinstance(value, (tuple, list, dict)):
        for item in value.values() if isinstance(value, dict) else value:
            yield from _descs(item, depth - 1)


INTRO = """\
Every family gpuio-exporter exposes today.  Units are base units; counters end in `_total`; `_info`
families have the value 1 and carry metadata in labels.  A label value taken from the host (a path, a
mount point, a cgroup, an engine name a process chose) is valid UTF-8 whatever the host's bytes: a byte
that is not UTF-8 shows as the four characters `\\xNN` (a file `bad\\xff.plan`), as `ls -b` shows it.

Disk counters have node_exporter's semantics: `gpuio_disk_<suffix>` equals `node_disk_<suffix>` on the
same /proc/diskstats.  A kernel before 4.18 writes no discard fields and one before 5.5 no flush
fields: those series are then absent, not zero.  `discarded_sectors_total` stays in 512-byte sectors,
as node_exporter leaves it.

Joining a filesystem's device to the disks that carry its IO:

```promql
# Busy time of the disks that carry dm-1's IO, one series per physical disk
rate(gpuio_disk_io_time_seconds_total[1m])
  * on (instance, device)
    label_replace(gpuio_disk_physical_device_info{device="dm-1"}, "device", "$1", "physical_device", "(.+)")
```

`gpuio_disk_physical_device_info` names, for every exported device, the whole disks at the bottom of
its stack (partition -> disk, dm/md -> slaves, recursively); a plain disk names itself, so the join
works the same for every device.
"""

SECTIONS = (
    Section("Disks (`diskstats` collector)", (diskstats,), only=lambda desc: desc.kind != INFO),
    Section("Disk metadata (`diskstats` collector)", (diskstats,), only=lambda desc: desc.kind == INFO),
    Section("Pressure (`pressure` collector)", (pressure,)),
    Section("cgroup IO (`cgroup_io` collector)", (cgroup_io,), """\
Who does each disk's IO and who stalls on IO, per cgroup: cgroup v2's `io.stat` and `io.pressure`, or on a
cgroup v1 host blkio's throttle counters (no pressure there). The tree is walked in the background every
`--collector.cgroup_io.interval` (10 s); per device the `--collector.cgroup_io.top` (10) cgroups that read and
wrote the most bytes since the walk before are served, and the 10 whose IO pressure grew most, each for
`--collector.cgroup_io.hold` (10 m) after it was last among them. The values are the kernel's own counters, so
`rate()` is right across a series' coming and going. `device` joins `gpuio_disk_*`; `cgroup` joins
`gpuio_cgroup_info` for the pod or service. Top readers of a disk:
`topk(5, rate(gpuio_cgroup_io_read_bytes_total{device="nvme1n1"}[1m])) * on (instance, cgroup) group_left \
(pod_uid, container_id, service) gpuio_cgroup_info`. See docs/cgroup-io.md.
"""),
    Section("The exporter itself", (collect, server_metrics, process)),
    Section("SMART (`smart` collector)", (smart,), """\
Polled in the background every `--collector.smart.interval` (5m); a scrape serves the last poll. `device`
joins `gpuio_disk_*` (an NVMe controller's values repeat for each of its namespaces; a disk behind a RAID
controller is named by its smartctl address, e.g. `bus/0:megaraid,16`). A disk whose poll fails or finds
it asleep keeps its last values: compare `gpuio_smart_last_success_timestamp_seconds` with `time()` to
see how old they are. See docs/smart.md.
"""),
    Section("GPUs (`nvml` collector)", (nvml,), """\
Read from NVML by a background thread every `--collector.nvml.interval` (1 s); the costly fields
(marked *slow*) every `--collector.nvml.slow-interval` (10 s).  `gpu` is NVML's index, `uuid` the
GPU's UUID.  A series NVML does not support on a GPU or driver is absent, not zero.  A GPU that is
lost or gone from the bus keeps only `gpuio_gpu_up` 0, `gpuio_gpu_info` and its Xid series.
docs/gpu.md says what each value is, how it is read and what it costs.
"""),
    Section("GPU time (`nvml` collector, with the `engines` collector's work)", (nvml_ledger,), """\
Every second of every GPU and MIG device, accounted at each NVML sweep to one state: `serving` (an engine
has requests in flight on it), `loading` (a load to it in progress), `starved` (work waiting while the
device has lost its activity and a disk under the engine's files is saturated: the judgement `gpuio top`
and the starvation rules make), `allocated_idle` (a pod or a compute process holds it, no engine work),
`idle`; the states add up to the wall time. GPU-hours by state:
`sum by (state) (increase(gpuio_gpu_time_seconds_total[1d])) / 3600`; per namespace from the pod series:
`sum by (namespace, state) (increase(gpuio_pod_gpu_time_seconds_total[1d])) / 3600`. See docs/gpu.md,
"GPU time".
"""),
    Section("Pods (`pods` collector)", (pods,), """\
Which namespace, pod and container holds each GPU, MIG device or time-slicing replica, from the
kubelet's pod-resources API (`List`, polled in the background; opt-in, docs/deploy.md "Pods"). GPU
series join it on `uuid`: `* on (uuid) group_left (namespace, pod, container) gpuio_gpu_pod_info`.
Off Kubernetes, or without the socket, the collector is `absent` and serves nothing.
"""),
    Section("Mounts (`mountstats` collector)", (mountstats,), """\
Network and FUSE mounts (nfs, nfs4, cifs, smb3, ceph, glusterfs, lustre, 9p, virtiofs, `fuse.*`...)
have no block device, so the disk series cannot describe engines on them. `gpuio_mount_info` lists
them and `gpuio_engine_mount_info` names each engine file's mount. NFS mounts get node_exporter's
mountstats series one to one (`node_mountstats_nfs_X` is `gpuio_mountstats_nfs_X`, same values) plus
a `mountpoint` label; operations never used (zero requests) are left out. Read from the host's
`/proc/1/mountstats` and `/proc/1/mountinfo` where visible, else the exporter's own (docs/mounts.md).
Mean round trip of reads on a mount:
`rate(gpuio_mountstats_nfs_operations_response_time_seconds_total{operation="READ"}[1m]) / \
rate(gpuio_mountstats_nfs_operations_requests_total{operation="READ"}[1m])`.
"""),
    Section("Engines (`engines` collector)", (engines,), """\
Reported by inference processes through the spool (`--collector.engines.spool-dir`; the library in
`exporter/instrument/`) and measured by the exporter on engine files (the files processes loaded, plus
`--collector.engines.path` globs). Histograms have `_bucket`/`_sum`/`_count` series with fixed buckets
(docs/engines.md); the engine histograms no rule or board takes a quantile of are served as summaries
(`_sum`/`_count` only) unless named in `--collector.engines.histogram-buckets`. Counters of processes
that exited are folded in, so they never go backwards while the exporter runs. `gpu_uuid` is the
NVML UUID (`uuid` on `gpuio_gpu_*`); `device` and `physical_device` join `gpuio_disk_*`. Residency
comes from a background scan every `--collector.engines.residency-interval`. See docs/engines.md.

Work waiting is judged per engine *and* GPU: `gpuio_engine_inferences_in_flight`, the pool gauges and
the `inference_seconds` and `pool_wait_seconds` histograms carry `gpu_uuid` (the GPU each process
recorded for the engine, else the one NVML lists it on, else ""), so a spare replica on another GPU
does not inherit the busy one's requests; `sum by (engine)` gives the old per-engine view. Loads are
reported from their start: while a load runs, `gpuio_engine_info` (and `_physical_device_info`,
`_mount_info`) already name its file, disk and GPU, and the `*_loads_in_progress` gauges count it per
engine and GPU, per physical disk (`device` equals `gpuio_disk_*`'s) and per mount point
(`mountpoint` equals `gpuio_mount_info`'s and `gpuio_mountstats_nfs_*`'s). Every engine GPU, disk and
mount point of an engine file has these series, at 0 when nothing loads (so `max by` and joins find
them). A process that died mid-load has no load in progress.
"""),
)


class DuplicateFamily(ValueError):
    """Two declarations of one family name: the exporter would serve it twice, the reference list it twice."""


def families_of(sections: Sequence[Section]) -> list[tuple[Section, Desc]]:
    """Each declared family once, with the section that lists it, in the reference's order."""
    listed: list[tuple[Section, Desc]] = []
    seen: dict[str, Desc] = {}
    for section in sections:
        for module in section.modules:
            for desc in declared_in(module):
                if section.only is not None and not section.only(desc):
                    continue
                if desc.name in seen:
                    if seen[desc.name] is desc:
                        continue  # one declaration, held by a second name or container
                    raise DuplicateFamily(f"{desc.name} is declared twice (the second time in {module.__name__})")
                seen[desc.name] = desc
                listed.append((section, desc))
    return listed


LISTED = families_of(SECTIONS)
FAMILIES: tuple[Desc, ...] = tuple(desc for _, desc in LISTED)
BY_NAME: dict[str, Desc] = {desc.name: desc for desc in FAMILIES}


def by_name(name: str) -> Desc:
    """The declaration of a family (KeyError names the family when there is none)."""
    try:
        return BY_NAME[name]
    except KeyError:
        raise KeyError(f"no family {name} is declared (exporter/catalogue.py lists them all)") from None


def names() -> frozenset[str]:
    return frozenset(BY_NAME)


# --- the reference, docs/metrics.md -----------------------------------------------------------------

HEADER = ("<!-- Generated by `python -m exporter.catalogue --write docs/metrics.md` from the families' "
          "declarations beside the code that produces them. Do not edit: change those and regenerate. -->\n")


def labels_cell(desc: Desc) -> str:
    """``device, state (ok, absent)``: the label names, with the values of those that take a fixed few."""
    return ", ".join(f"{label} ({', '.join(desc.values[label])})" if label in desc.values else label
                     for label in desc.labels)


def row(desc: Desc) -> str:
    cells = (f"`{desc.name}`", desc.kind, labels_cell(desc), desc.doc)
    for cell in cells:
        if "|" in cell or "\n" in cell:
            raise ValueError(f"{desc.name}: a table cell cannot hold '|' or a line break: {cell!r}")
    return "| " + " | ".join(cells) + " |"


def render_markdown(listed: Sequence[tuple[Section, Desc]] = LISTED, intro: str = INTRO,
                    sections: Sequence[Section] = SECTIONS) -> str:
    parts = [HEADER, "# Metric reference\n\n", intro]
    for section in sections:
        rows = [row(desc) for owner, desc in listed if owner is section]
        if not rows:
            continue
        parts.append(f"\n## {section.title}\n\n")
        if section.intro:
            parts.append(section.intro + "\n")
        parts.append("| metric | type | labels | meaning |\n|---|---|---|---|\n")
        parts.extend(line + "\n" for line in rows)
    return "".join(parts)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m exporter.catalogue",
                                     description="Print the metric reference (docs/metrics.md), generated from "
                                                 "the declarations; or write it, or check it.")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--write", metavar="PATH", help="write the reference to PATH")
    action.add_argument("--check", metavar="PATH", help="exit 1 if PATH is not what would be written")
    args = parser.parse_args(argv)
    text = render_markdown()
    if args.write:
        with open(args.write, "w", encoding="utf-8") as file:
            file.write(text)
        return 0
    if args.check:
        try:
            with open(args.check, encoding="utf-8") as file:
                current = file.read()
        except FileNotFoundError:
            current = None
        if current != text:
            print(f"stale: {args.check} (run python -m exporter.catalogue --write {args.check})", file=sys.stderr)
            return 1
        return 0
    sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
