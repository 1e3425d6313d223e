"""Alert templates: Go-template snippets that print a live figure, a label or a list (engines on a
disk, starved GPUs) in an alert's description, picked by the alert's own labels."""

from __future__ import annotations

from ..config import Config
from .names import names

# Formats of numbers in alert templates.
ONE_DECIMAL = 'printf "%.1f"'
COUNT = 'printf "%.0f"'
# A GPU as the alerts name it (labels of the nvml collector's series).
GPU_NAME = "GPU {{ $labels.gpu }} ({{ $labels.uuid }})"
# The device an engine runs on: a GPU, or a MIG device of one (its GPU instance named).
DEVICE_NAME = "GPU {{ $labels.gpu }}{{ with $labels.gpu_instance }} MIG instance {{ . }}{{ end }}"


def figure(metric: str, labels: tuple[str, ...], fmt: str, missing: str = "none") -> str:
    """An alert template that prints one series' current value, picked by the alert's own labels."""
    matchers = ",".join(f"{label}='%s'" for label in labels)
    args = " ".join(f"$labels.{label}" for label in labels)
    return (f'{{{{ with printf "{metric}{{{matchers}}}" {args} | query }}}}'
            f"{{{{ . | first | value | {fmt} }}}}{{{{ else }}}}{missing}{{{{ end }}}}")


def node_figure(c: Config, metric: str, fmt: str, missing: str = "none") -> str:
    return figure(metric, (c.NODE_LABEL,), fmt, missing)


def device_figure(c: Config, metric: str, fmt: str, missing: str = "none") -> str:
    return figure(metric, (c.NODE_LABEL, "device"), fmt, missing)


def label_of(metric: str, label: str, labels: tuple[str, ...], missing: str = "", condition: str = "") -> str:
    """An alert template that prints a label of the first series of ``metric`` picked by the alert's labels."""
    matchers = ",".join(f"{name}='%s'" for name in labels)
    args = " ".join(f"$labels.{name}" for name in labels)
    return (f'{{{{ with printf "{metric}{{{matchers}}}{condition}" {args} | query }}}}'
            f'{{{{ with first . }}}}{{{{ label "{label}" . }}}}{{{{ end }}}}{{{{ else }}}}{missing}{{{{ end }}}}')


def held_on_storage(c: Config, info: str, label: str) -> str:
    """A printf pattern (node, then storage) of ``info`` (an engine -> disk or mount info family) for one disk
    or mount, held for ENGINE_HOLD as the rules hold it: a crash loop's engines are named between attempts."""
    return f"last_over_time({info}{{{c.NODE_LABEL}='%s',{label}='%s'}}[{c.ENGINE_HOLD}])"


def engines_on(c: Config, info: str, label: str, value_label: str) -> str:
    """An alert template listing the engines whose files are on the alert's disk or mount."""
    node = f"$labels.{c.NODE_LABEL}"
    return (f'{{{{ range printf "count by (engine) ({held_on_storage(c, info, label)})" '
            f"{node} $labels.{value_label} | query | sortByLabel \"engine\" }}}}{{{{ .Labels.engine }}}} "
            f"{{{{ else }}}}none {{{{ end }}}}")


def gpus_on(c: Config, info: str, label: str, value_label: str) -> str:
    """An alert template listing the GPUs of the engines whose files are on the alert's disk or mount: by
    NVML index and UUID where the node's GPU data joins, else by the UUID the engines' processes report."""
    n = names(c)
    node = f"$labels.{c.NODE_LABEL}"
    on_storage = f"on ({c.NODE_LABEL}, engine, path) {held_on_storage(c, info, label)}"
    by_nvml = f"count by (gpu, uuid) ({n.ENGINE_GPU_ACTIVITY}{{{c.NODE_LABEL}='%s'}} and {on_storage})"
    by_writer = (f"count by (gpu_uuid) (last_over_time(gpuio_engine_info{{{c.NODE_LABEL}='%s',gpu_uuid!=''}}"
                 f"[{c.ENGINE_HOLD}]) and {on_storage})")
    args = f"{node} {node} $labels.{value_label}"
    return (f'{{{{ range printf "{by_nvml}" {args} | query | sortByLabel "gpu" }}}}'
            f"GPU {{{{ .Labels.gpu }}}} ({{{{ .Labels.uuid }}}}) {{{{ else }}}}"
            f'{{{{ range printf "{by_writer}" {args} | query | sortByLabel "gpu_uuid" }}}}'
            f"{{{{ .Labels.gpu_uuid }}}} {{{{ else }}}}none known {{{{ end }}}}{{{{ end }}}}")


def waiting_to_load(c: Config, info: str, label: str, value_label: str) -> str:
    """An alert template: how many engines on the alert's disk or mount are waited for while they load or
    crash-loop (LOADS_WAITED_FOR, one per engine and device; a crash loop counts between attempts too)."""
    n = names(c)
    node = f"$labels.{c.NODE_LABEL}"
    query = (f"count({n.LOADS_WAITED_FOR}{{{c.NODE_LABEL}='%s'}} and on ({c.NODE_LABEL}, engine) "
             f"{held_on_storage(c, info, label)})")
    return (f'{{{{ with printf "{query}" {node} {node} $labels.{value_label} | query }}}}'
            f'{{{{ . | first | value | printf "%.0f" }}}}{{{{ else }}}}0{{{{ end }}}}')


def starved_count(c: Config, label: str) -> str:
    n = names(c)
    node = f"$labels.{c.NODE_LABEL}"
    return (f'{{{{ with printf "count({n.STARVED}{{{c.NODE_LABEL}=\'%s\',{label}=\'%s\'}})" {node} $labels.{label} '
            f'| query }}}}{{{{ . | first | value | printf "%.0f" }}}}{{{{ else }}}}0{{{{ end }}}}')


def starved_on(c: Config, label: str) -> str:
    n = names(c)
    node = f"$labels.{c.NODE_LABEL}"
    return (f'{{{{ range printf "{n.STARVED}{{{c.NODE_LABEL}=\'%s\',{label}=\'%s\'}}" {node} $labels.{label} '
            f'| query | sortByLabel "gpu" }}}}{{{{ .Labels.engine }}}} on GPU {{{{ .Labels.gpu }}}}'
            f"{{{{ with .Labels.gpu_instance }}}} MIG instance {{{{ . }}}}{{{{ end }}}} (active "
            f"{{{{ .Value | humanizePercentage }}}}) {{{{ else }}}}none {{{{ end }}}}")


def engine_gpu_figure(c: Config, metric: str, fmt: str, missing: str) -> str:
    """An alert template: ``metric`` of the alert's engine on the alert's GPU (labels engine, uuid)."""
    node = f"$labels.{c.NODE_LABEL}"
    return (f'{{{{ with printf "{metric}{{{c.NODE_LABEL}=\'%s\',engine=\'%s\',gpu_uuid=\'%s\'}}" {node} '
            f"$labels.engine $labels.uuid | query }}}}{{{{ . | first | value | {fmt} }}}}{{{{ else }}}}{missing}"
            f"{{{{ end }}}}")


def top_io_cgroups(c: Config) -> str:
    """An alert template naming the cgroups that read and wrote the most on the alert's disk (bytes a
    second over STORM_TOP_CGROUPS_WINDOW, the cgroup_io collector's series), with the pod UID or systemd
    service where the cgroup is one; nothing at all where the collector serves none for the disk."""
    node = f"$labels.{c.NODE_LABEL}"
    on_disk, window = f"{{{c.NODE_LABEL}='%s',device='%s'}}", c.STORM_TOP_CGROUPS_WINDOW
    # read and written are served together for every cgroup and disk (collectors/cgroup_io.py)
    io_bytes = (f"rate(gpuio_cgroup_io_read_bytes_total{on_disk}[{window}]) + "
                f"rate(gpuio_cgroup_io_written_bytes_total{on_disk}[{window}])")
    per_cgroup = (f"sum by ({c.NODE_LABEL}, cgroup) ({io_bytes}) "
                  f"* on ({c.NODE_LABEL}, cgroup) group_left (pod_uid, service) "
                  f"max by ({c.NODE_LABEL}, cgroup, pod_uid, service) (gpuio_cgroup_info)")
    query = f"sort_desc(topk({c.STORM_TOP_CGROUPS}, {per_cgroup} > 0))"
    who = ("{{ with $cgroup.Labels.service }}service {{ . }}{{ else }}{{ with $cgroup.Labels.pod_uid }}pod {{ . }}"
           "{{ else }}cgroup {{ $cgroup.Labels.cgroup }}{{ end }}{{ end }}")
    args = f"{node} $labels.device {node} $labels.device"
    return (f'{{{{ with printf "{query}" {args} | query }}}} Doing the most IO on it: '
            f'{{{{ range $index, $cgroup := . }}}}{{{{ if $index }}}}, {{{{ end }}}}{who} '
            f'({{{{ $cgroup.Value | humanize1024 }}}}B/s){{{{ end }}}}.{{{{ end }}}}')
