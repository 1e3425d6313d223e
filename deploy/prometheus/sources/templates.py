"""Alert templates: Go-template snippets that print a live figure, a label or a list (engines on a
disk, starved GPUs) in an alert's description, picked by the alert's own labels."""

from __future__ import annotations

from ..config import Config
from .base import fill
from .names import names

# Formats of numbers in alert templates.
ONE_DECIMAL = 'printf "%.1f"'
COUNT = 'printf "%.0f"'
# A GPU as the alerts name it (labels of the nvml collector's series).
GPU_NAME = "GPU {{ $labels.gpu }} ({{ $labels.uuid }})"
# The device an engine runs on: a GPU, or a MIG device of one (its GPU instance named).
DEVICE_NAME = "GPU {{ $labels.gpu }}{{ with $labels.gpu_instance }} MIG instance {{ . }}{{ end }}"


def query_figure(query: str, args: str, fmt: str, missing: str) -> str:
    """An alert template that runs ``query`` (a printf pattern, filled with ``args``: the alert's labels)
    and prints the first value as ``fmt``, or ``missing`` where the query finds nothing."""
    return fill('{{ with printf "${query}" ${args} | query }}{{ . | first | value | ${fmt} }}'
                "{{ else }}${missing}{{ end }}", query=query, args=args, fmt=fmt, missing=missing)


def figure(metric: str, labels: tuple[str, ...], fmt: str, missing: str = "none") -> str:
    """An alert template that prints one series' current value, picked by the alert's own labels."""
    matchers = ",".join(f"{label}='%s'" for label in labels)
    args = " ".join(f"$labels.{label}" for label in labels)
    return query_figure(fill("${metric}{${matchers}}", metric=metric, matchers=matchers), args, fmt, missing)


def node_figure(config: Config, metric: str, fmt: str, missing: str = "none") -> str:
    return figure(metric, (config.NODE_LABEL,), fmt, missing)


def device_figure(config: Config, metric: str, fmt: str, missing: str = "none") -> str:
    return figure(metric, (config.NODE_LABEL, "device"), fmt, missing)


def label_of(metric: str, label: str, labels: tuple[str, ...], missing: str = "", condition: str = "") -> str:
    """An alert template that prints a label of the first series of ``metric`` picked by the alert's labels."""
    matchers = ",".join(f"{name}='%s'" for name in labels)
    args = " ".join(f"$labels.{name}" for name in labels)
    return fill('{{ with printf "${metric}{${matchers}}${condition}" ${args} | query }}'
                '{{ with first . }}{{ label "${label}" . }}{{ end }}{{ else }}${missing}{{ end }}',
                metric=metric, matchers=matchers, condition=condition, args=args, label=label, missing=missing)


def held_on_storage(config: Config, info: str, label: str) -> str:
    """A printf pattern (node, then storage) of ``info`` (an engine -> disk or mount info family) for one disk
    or mount, held for ENGINE_HOLD as the rules hold it: a crash loop's engines are named between attempts."""
    return fill("last_over_time(${info}{${node}='%s',${label}='%s'}[${hold}])",
                info=info, node=config.NODE_LABEL, label=label, hold=config.ENGINE_HOLD)


def engines_on(config: Config, info: str, label: str, value_label: str) -> str:
    """An alert template listing the engines whose files are on the alert's disk or mount."""
    return fill('{{ range printf "count by (engine) (${on_storage})" $labels.${node} $labels.${value_label} '
                '| query | sortByLabel "engine" }}{{ .Labels.engine }} {{ else }}none {{ end }}',
                on_storage=held_on_storage(config, info, label), node=config.NODE_LABEL, value_label=value_label)


def gpus_on(config: Config, info: str, label: str, value_label: str) -> str:
    """An alert template listing the GPUs of the engines whose files are on the alert's disk or mount: by
    NVML index and UUID where the node's GPU data joins, else by the UUID the engines' processes report."""
    on_storage = f"on ({config.NODE_LABEL}, engine, path) {held_on_storage(config, info, label)}"
    by_nvml = fill("count by (gpu, uuid) (${activity}{${node}='%s'} and ${on_storage})",
                   activity=names(config).ENGINE_GPU_ACTIVITY, node=config.NODE_LABEL, on_storage=on_storage)
    by_writer = fill("count by (gpu_uuid) (last_over_time(gpuio_engine_info{${node}='%s',gpu_uuid!=''}[${hold}]) "
                     "and ${on_storage})", node=config.NODE_LABEL, hold=config.ENGINE_HOLD, on_storage=on_storage)
    return fill('{{ range printf "${by_nvml}" ${args} | query | sortByLabel "gpu" }}'
                "GPU {{ .Labels.gpu }} ({{ .Labels.uuid }}) {{ else }}"
                '{{ range printf "${by_writer}" ${args} | query | sortByLabel "gpu_uuid" }}'
                "{{ .Labels.gpu_uuid }} {{ else }}none known {{ end }}{{ end }}",
                by_nvml=by_nvml, by_writer=by_writer, args=storage_args(config, value_label))


def storage_args(config: Config, value_label: str) -> str:
    """The printf arguments of a pattern that names the alert's node twice, then its disk or mount."""
    node = f"$labels.{config.NODE_LABEL}"
    return f"{node} {node} $labels.{value_label}"


def waiting_to_load(config: Config, info: str, label: str, value_label: str) -> str:
    """An alert template: how many engines on the alert's disk or mount are waited for while they load or
    crash-loop (LOADS_WAITED_FOR, one per engine and device; a crash loop counts between attempts too)."""
    query = fill("count(${waited_for}{${node}='%s'} and on (${node}, engine) ${held})",
                 waited_for=names(config).LOADS_WAITED_FOR, node=config.NODE_LABEL,
                 held=held_on_storage(config, info, label))
    return query_figure(query, storage_args(config, value_label), COUNT, "0")


def starved_count(config: Config, label: str) -> str:
    query = fill("count(${starved}{${node}='%s',${label}='%s'})",
                 starved=names(config).STARVED, node=config.NODE_LABEL, label=label)
    return query_figure(query, f"$labels.{config.NODE_LABEL} $labels.{label}", COUNT, "0")


def starved_on(config: Config, label: str) -> str:
    pattern = fill("${starved}{${node}='%s',${label}='%s'}",
                   starved=names(config).STARVED, node=config.NODE_LABEL, label=label)
    return fill('{{ range printf "${pattern}" $labels.${node} $labels.${label} | query | sortByLabel "gpu" }}'
                "{{ .Labels.engine }} on GPU {{ .Labels.gpu }}{{ with .Labels.gpu_instance }} MIG instance "
                "{{ . }}{{ end }} (active {{ .Value | humanizePercentage }}) {{ else }}none {{ end }}",
                pattern=pattern, node=config.NODE_LABEL, label=label)


def engine_gpu_figure(config: Config, metric: str, fmt: str, missing: str) -> str:
    """An alert template: ``metric`` of the alert's engine on the alert's GPU (labels engine, uuid)."""
    query = fill("${metric}{${node}='%s',engine='%s',gpu_uuid='%s'}", metric=metric, node=config.NODE_LABEL)
    return query_figure(query, f"$labels.{config.NODE_LABEL} $labels.engine $labels.uuid", fmt, missing)


def top_io_cgroups(config: Config) -> str:
    """An alert template naming the cgroups that read and wrote the most on the alert's disk (bytes a
    second over STORM_TOP_CGROUPS_WINDOW, the cgroup_io collector's series), with the pod UID or systemd
    service where the cgroup is one; nothing at all where the collector serves none for the disk."""
    node, window = config.NODE_LABEL, config.STORM_TOP_CGROUPS_WINDOW
    on_disk = fill("{${node}='%s',device='%s'}", node=node)
    # read and written are served together for every cgroup and disk (collectors/cgroup_io.py)
    io_bytes = (f"rate(gpuio_cgroup_io_read_bytes_total{on_disk}[{window}]) + "
                f"rate(gpuio_cgroup_io_written_bytes_total{on_disk}[{window}])")
    per_cgroup = (f"sum by ({node}, cgroup) ({io_bytes}) "
                  f"* on ({node}, cgroup) group_left (pod_uid, service) "
                  f"max by ({node}, cgroup, pod_uid, service) (gpuio_cgroup_info)")
    query = f"sort_desc(topk({config.STORM_TOP_CGROUPS}, {per_cgroup} > 0))"
    who = ("{{ with $cgroup.Labels.service }}service {{ . }}{{ else }}{{ with $cgroup.Labels.pod_uid }}pod {{ . }}"
           "{{ else }}cgroup {{ $cgroup.Labels.cgroup }}{{ end }}{{ end }}")
    node_and_disk = f"$labels.{node} $labels.device"
    return fill('{{ with printf "${query}" ${args} | query }} Doing the most IO on it: '
                "{{ range $index, $cgroup := . }}{{ if $index }}, {{ end }}${who} "
                "({{ $cgroup.Value | humanize1024 }}B/s){{ end }}.{{ end }}",
                query=query, args=f"{node_and_disk} {node_and_disk}", who=who)
