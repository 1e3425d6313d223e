"""The one place for the knobs of gpuio's rules, alerts and dashboards (the "mixin config").

``Config`` holds every knob, with its default; ``DEFAULT`` is the config of the checked-in rules and
boards.  It is frozen: a variant (shorter windows for an end-to-end test, your own Grafana) is
``dataclasses.replace(DEFAULT, STORM_FOR="10s")``, passed to the rule sources - nothing is changed in
place.  Every generator receives the config it writes for: the rules (sources/), the boards
(deploy/grafana/boards/), the runbooks (runbooks.py); ``config.thresholds`` is what `gpuio top` judges by.
A knob is read from the config at hand (``config.STORM_FOR``), never from a module default, so
nothing can judge by a number the config did not give it.

Change a default here, run ``make generate``, commit the regenerated YAML and JSON: the drift tests
(tests/unit/test_rules.py, test_dashboards.py, test_deploy_kubernetes.py) fail while the checked-in
files differ from what ``python -m deploy.generate`` writes.

The per-class disk limits, the IO-pressure limits and the GPU-idle limit are not repeated here: they
come from exporter/thresholds.py, the module `gpuio top` judges its rows by, so what is red on the
node's screen is what the alerts fire on.  This module adds what only rules need: selectors,
windows, how far above its own baseline a device must be, durations, link bases.

Why these shapes (see docs/runbooks/DiskIOStorm.md for the on-call view):

* Never %util alone.  %util is the share of time with at least one request in flight; a device
  that serves requests in parallel (NVMe, a cloud volume, md/dm over several disks) sits at 100 %
  with headroom to spare.  node-mixin's NodeDiskIOSaturation paged on exactly that.  What work
  feels is await (time per request) and how many requests pile up (aqu-sz); what the node feels
  is IO pressure (PSI: time in which tasks stalled on IO).
* Absolute limits per device class (exporter/thresholds.py): NVMe and network block devices (rbd,
  nbd) by name, then solid state vs rotational from gpuio_disk_info{rotational}: an HDD seeks in
  5-15 ms, so 20 ms is a normal busy HDD but an alarm on flash.
* Relative to the device's own calm normal: a cloud volume whose await is always 15 ms is above the
  flash limit all day; only "4x its own median" says something changed.  The median is taken over
  BASELINE_WINDOW of the evaluations in which the device was not saturated, and held for
  BASELINE_HOLD once learned: a storm never feeds its own baseline, so a storm of hours keeps firing.
  A device with no calm evidence (it idled until the rollout, or was saturated from its first sample)
  has no baseline; then the absolute limits alone decide.
* Who it hurts decides the severity: saturation alone opens a ticket; saturation while engine loads
  wait on the disk, or engines on it starve their GPUs, pages.
* Awaits are judged only for a direction (reads, writes) that completed at least
  AWAIT_MIN_IOPS requests per second: one slow read on an idle disk is not a storm, and a
  direction with no completions has no await at all (the recording rules divide by ``(ops > 0)``,
  so an idle device yields no series rather than NaN).
"""

from __future__ import annotations

import dataclasses

from ..exporter_modules import thresholds

# --- disk classes (exporter/thresholds.py: the limits `gpuio top` judges its rows by) ------------------
SOLID_STATE = thresholds.DISK_CLASSES[thresholds.SOLID_STATE]
ROTATIONAL = thresholds.DISK_CLASSES[thresholds.ROTATIONAL]
NVME = thresholds.DISK_CLASSES[thresholds.NVME]
NETWORK = thresholds.DISK_CLASSES[thresholds.NETWORK]
DISK_CLASSES = thresholds.DISK_CLASSES
DEVICE_NAME_CLASSES = thresholds.DEVICE_NAME_CLASSES

# --- severities ----------------------------------------------------------------------------------
# deploy/alertmanager/alertmanager.yml routes on these: critical pages, warning opens a ticket,
# info only shows on dashboards.
CRITICAL = "critical"
WARNING = "warning"
INFO = "info"
SEVERITIES = (CRITICAL, WARNING, INFO)

# --- dashboards ----------------------------------------------------------------------------------
# uid -> title.  The uid is part of every dashboard_url, so it never changes.
DISK_IO_UID = "gpuio-disk-io"
STARVATION_UID = "gpuio-starvation"
GPU_UID = "gpuio-gpu"
ENGINES_UID = "gpuio-engines"
DISK_HEALTH_UID = "gpuio-disk-health"
DASHBOARD_TITLES = {
    DISK_IO_UID: "gpuio / Disk IO",
    STARVATION_UID: "gpuio / Starvation (on-call)",
    GPU_UID: "gpuio / GPU",
    ENGINES_UID: "gpuio / Engines",
    DISK_HEALTH_UID: "gpuio / Disk health",
}
DASHBOARD_TAG = "gpuio"

# --- disk series ---------------------------------------------------------------------------------
# Config.DISK_SOURCE: gpuio's own diskstats collector, or node_exporter's (the rules' "node_exporter mode").
GPUIO, NODE_EXPORTER = "gpuio", "node_exporter"
DISK_SOURCES = (GPUIO, NODE_EXPORTER)

# --- links ---------------------------------------------------------------------------------------
# Where on-call finds the runbook and the board of an alert (its runbook_url and dashboard_url).
# gpuio knows no host of yours, so the defaults are the two paths that are true in every installation:
# the runbook's file in this repository (docs/runbooks/<Alert>.md) and the board's path on whatever
# Grafana loads dashboards/*.json (/d/<uid>/<uid>?var-instance=...).  Point them at your wiki and
# Grafana with `python -m deploy.generate --runbook-url ... --grafana-url ...` (or the environment
# variables below); docs/deploy.md ("Links in alerts") shows how.
RUNBOOK_URL_ENV = "GPUIO_RUNBOOK_URL"
GRAFANA_URL_ENV = "GPUIO_GRAFANA_URL"
DEFAULT_RUNBOOK_URL = "docs/runbooks/{alert}.md"
DEFAULT_GRAFANA_URL = ""


@dataclasses.dataclass(frozen=True)
class Config:
    """Every knob of the rules and alerts.  Names are upper case: they are constants of one config, and
    the names that docs, runbooks and ``--set NAME=VALUE`` use."""

    # --- selectors -------------------------------------------------------------------------------------
    # Picks gpuio's series out of everything Prometheus scrapes.  Every rule and panel uses it.
    SELECTOR: str = 'job="gpuio"'
    # The label that names a node.  Alerts group on it and inhibitions match on it; relabel `instance`
    # to the node's name in the scrape config (as node_exporter's docs recommend) for readable pages.
    NODE_LABEL: str = "instance"
    # Where the disk series come from.  "gpuio": its diskstats collector (gpuio_disk_*).  "node_exporter":
    # the node_exporter you already run (node_disk_*, picked by NODE_EXPORTER_SELECTOR), with gpuio's
    # diskstats collector off: the disk recording rules read node_disk_* and carry gpuio's job, so every
    # rule, alert and board after them is the same in both modes.  Both exporters must name a node alike
    # in NODE_LABEL (kube-prometheus-stack relabels node-exporter's `instance` to the node's name; relabel
    # gpuio's the same way), and the storm alerts hold through a gap of either one (sources/exporter.py).
    DISK_SOURCE: str = "gpuio"
    NODE_EXPORTER_SELECTOR: str = 'job="node-exporter"'
    # dcgm-exporter's series (NVIDIA's GPU Operator names its job nvidia-dcgm-exporter, its Helm chart
    # dcgm-exporter).  Where gpuio has no GPM (GPUs before Hopper) and dcgm-exporter serves a whole GPU's
    # DCGM_FI_PROF_SM_ACTIVE, that stands in for GPM's SM activity (joined by GPU UUID, whatever node label
    # dcgm-exporter carries); where neither measures it, NVML busy decides.  Nothing to set up: no
    # dcgm-exporter, no such series.
    DCGM_SELECTOR: str = 'job=~".*dcgm.*"'

    # One Grafana looking at several Prometheus servers (or clusters), told apart by a `cluster` label (an
    # external label, or one added by federation or remote write): the boards show their Cluster variable.
    # Off, it is hidden: with one Prometheus it has one value or none, and "All" matches series without it.
    MULTI_CLUSTER: bool = False

    # --- windows -------------------------------------------------------------------------------------
    # rate() window of the recording rules: needs at least two scrapes inside it, so a scrape interval
    # of 30 s or less (15 s recommended).  Recording-rule names carry it (`:rate1m`).
    RATE_WINDOW: str = "1m"
    # The window of a device's own normal: median of its await and queue size over this long, from the
    # evaluations in which the device was NOT saturated (a storm never feeds its own baseline).
    BASELINE_WINDOW: str = "1h"
    # A baseline needs evidence: a calm judged await (enough IOPS, not saturated) in at least this share
    # of the window's evaluations.  A disk that idled for an hour has none, and the class limits decide.
    BASELINE_MIN_COVERAGE: float = 0.5
    # Once learned, a baseline holds for this long after its evidence ran out: through a storm of hours the
    # device is still judged against its last calm normal (and a storm can never become the normal, since
    # saturated evaluations never feed it).
    BASELINE_HOLD: str = "6h"

    # --- disk limits (the numbers gpuio top uses) ---------------------------------------------------
    AWAIT_MIN_IOPS: float = thresholds.AWAIT_MIN_IOPS
    IO_PRESSURE_SOME: float = thresholds.IO_PRESSURE_SOME
    IO_PRESSURE_FULL: float = thresholds.IO_PRESSURE_FULL
    GPU_BUSY_LOW: float = thresholds.GPU_BUSY_LOW
    # Where GPM measures SM activity (Hopper and newer) a GPU is also idle below this share of SMs working,
    # whatever NVML's busy says (busy reads 100 % while weights cross PCIe with no SM running).
    GPU_SM_ACTIVE_LOW: float = thresholds.GPU_SM_ACTIVE_LOW

    # --- DiskIOStorm ---------------------------------------------------------------------------------
    # Await and queue size must both be at least this many times the device's baseline (its median over
    # BASELINE_WINDOW), on top of the class limits above.
    STORM_BASELINE_FACTOR: float = 4.0
    # A storm with no victim (nothing gpuio sees waits on the disk): a ticket after this long.
    STORM_FOR: str = "5m"
    # A storm that hurts serving pages after this long: engine loads in progress on the disk (or mount),
    # engines on it starving their GPUs, or engines on it queueing work while the node's IO pressure
    # "full" is at least STORM_PAGE_IO_FULL.  Shorter than STORM_FOR: a cold-start wave is seen while it
    # happens.  First page: the rate window filling plus this, 2.5-3 minutes into the storm.
    STORM_PAGE_FOR: str = "2m"
    STORM_PAGE_IO_FULL: float = 0.25
    # The description counts the engine loads from the stormed disk that finished in this window: many of
    # them at once is the cold-start storm (a rollout, an autoscaling burst).
    STORM_ENGINE_LOADS_WINDOW: str = "5m"
    # The storm's description names the cgroups (pods, containers, services) doing the most IO on the disk
    # (the cgroup_io collector's series, read over this window: it walks the cgroup tree every 10 s), at most
    # this many; absent from the description where the collector serves none.
    STORM_TOP_CGROUPS: int = 3
    STORM_TOP_CGROUPS_WINDOW: str = "2m"

    # --- network storage (NFS, CephFS, FUSE mounts) ------------------------------------------------------
    # A network mount is slow when the mean round trip of its NFS READs is at least this (with at least
    # AWAIT_MIN_IOPS READs a second), or when an engine load on it has been in progress for longer than
    # ENGINE_LOAD_SLOW_SECONDS (all a FUSE mount of an object store shows) - and the node's IO pressure is
    # high.  A 1 MiB READ from a healthy NFS server takes a few ms.
    NFS_READ_RTT_SLOW_SECONDS: float = 0.050

    # --- disk health (smart collector) ----------------------------------------------------------------
    # "Growing" is judged over this window: a disk with 100 reallocated sectors from its first year that
    # has not remapped one since is not news; one that remapped 8 today is.  SMART is polled every 5 min
    # (--collector.smart.interval), so a change shows in the next poll.
    SMART_GROWTH_WINDOW: str = "1d"
    # NVMe available spare: the drive itself raises its critical warning when spare falls below the vendor
    # threshold (typically 10 %); warn at this multiple of it, while there is time to order a disk.
    NVME_SPARE_WARN_FACTOR: float = 2.0
    SMART_HEALTH_FOR: str = "5m"
    # A disk's SMART values older than this (and the disk not asleep), or its polls failing (timeout, error,
    # permission denied) for SMART_STALE_FOR: the health alerts above are blind for it.
    SMART_STALE_AFTER_SECONDS: int = 1800
    SMART_STALE_FOR: str = "15m"

    # --- GPUs (nvml collector) ---------------------------------------------------------------------------
    # Clock-event reasons that mean trouble, and the share of GPU_THROTTLE_WINDOW they must hold the clocks
    # down (exporter/thresholds.py: `gpuio top` flags the same reasons).
    GPU_THROTTLE_REASONS: tuple[str, ...] = thresholds.GPU_THROTTLE_REASONS
    GPU_THROTTLE_RATIO: float = thresholds.GPU_THROTTLE_RATIO
    GPU_THROTTLE_WINDOW: str = "5m"
    GPU_THROTTLE_FOR: str = "10m"
    # PCIe generation drops at idle (power saving); it is judged only while the GPU is at least this busy.
    # Width is judged always.
    PCIE_GENERATION_BUSY: float = 0.5
    PCIE_DEGRADED_FOR: str = "10m"
    # Xid codes that report an application's fault (13 graphics engine exception, 31 MMU fault, 43 GPU
    # stopped processing, 45 preemptive cleanup), not the hardware's: no alert.
    XID_APPLICATION: tuple[str, ...] = ("13", "31", "43", "45")
    XID_RECENT_SECONDS: int = 900  # an Xid fires for this long after it was last seen
    GPU_ECC_WINDOW: str = "1h"
    GPU_LOST_FOR: str = "1m"
    # A GPU that NVML no longer enumerates (gone before the exporter or the driver restarted, so there is
    # no gpuio_gpu_up == 0 to see): fewer GPUs than the node had at any time in this window.  After a
    # planned removal the alert holds for this long: silence it.
    GPU_MISSING_WINDOW: str = "1d"
    # GPU data is stale when the NVML snapshot is older than this (the sampler reads every 1 s) or the nvml
    # collector failed, at any scrape within RATE_WINDOW: a frozen busy counter reads as an idle GPU, so no
    # starvation alert judges such a GPU; GpuioGPUDataStale fires instead (and inhibits them in Alertmanager).
    GPU_STALE_AFTER_SECONDS: int = 30
    GPU_STALE_FOR: str = "5m"
    # A GPU (or MIG device) held but unused: a pod holds it (the kubelet's pod resources) or NVML lists a
    # compute process on it, and no engine had work on it (the GPU-time ledger's allocated_idle state) for at
    # least GPU_ALLOCATED_IDLE_RATIO of the last GPU_ALLOCATED_IDLE_WINDOW, while the device itself was mostly
    # idle over it (GPU_BUSY_LOW; a MIG device: GPU_SM_ACTIVE_LOW): a training job gpuio follows no engine of
    # is allocated_idle to the ledger, and busy.  A cost, not an outage: a ticket.  Under 1, so that a scrape
    # gap (the exporter restarting: its seconds are counted by nobody) of up to (1 - ratio) x window does not
    # hide it; a device whose counters are younger than ratio x window (a fresh exporter, a new MIG device)
    # cannot fire yet.
    GPU_ALLOCATED_IDLE_WINDOW: str = "6h"
    GPU_ALLOCATED_IDLE_RATIO: float = 0.95
    # ... holding for this long: a pod that does a little work now and then, its share around the ratio,
    # opens no ticket on a single crossing.
    GPU_ALLOCATED_IDLE_FOR: str = "30m"
    # ... judged this often (its own rule group): its rates span the window, hours of samples per GPU.
    GPU_ALLOCATED_IDLE_EVAL_INTERVAL: str = "5m"

    # --- starvation ----------------------------------------------------------------------------------
    # Work waits on an engine on one GPU (judged per engine and GPU, never "a request is in flight"):
    # requests waiting this long (mean) for a pool context, or as many inferences in flight as the pool has
    # contexts, or p99 latency at least ENGINE_LATENCY_FACTOR x its calm median (learned, like the disk
    # baselines, only while the engine's storage was not saturated), or a load of the engine in progress
    # (or crash-looping: LOAD_CRASH_LOOP_WINDOW below).
    ENGINE_POOL_WAIT_SECONDS: float = thresholds.ENGINE_POOL_WAIT_SECONDS
    ENGINE_LATENCY_FACTOR: float = 2.0
    # A GPU has lost its work when it is mostly idle (GPU_BUSY_LOW, GPU_SM_ACTIVE_LOW) or its activity (SM
    # activity where GPM measures it, else NVML busy; a MIG device: its GPU instance's SM activity) fell
    # below this share of its calm normal: the median over BASELINE_WINDOW of the evaluations with no
    # saturated disk or slow mount on the node, held for BASELINE_HOLD.  A storm rarely stops a GPU dead;
    # it takes most of its throughput (measured on an H200: SM activity 0.90 -> 0.34 with every pool full).
    GPU_ACTIVITY_DROP: float = 0.5
    # GPUStarvedByDiskIO pages after this long.  The starved judgement is a conjunction (the device lost its
    # work, work waits for the engine on it, its storage is saturated or slow, the GPU data is fresh) that no
    # look-alike of the scenario suite holds for more than one evaluation, so the `for` only has to outlast
    # transients: a reload's saturating burst (30 s), a pod evicted once while loading (LOAD_RESTART_GRACE),
    # the rate window.  As long as the storm's page (STORM_PAGE_FOR): the page naming a GPU with its engine
    # comes 2 minutes after its starvation is first seen (about 2.5 minutes into a storm), whether or not
    # the storm's page, which names the GPUs starving when it fires, came before.
    STARVED_FOR: str = "2m"
    # NodeGPUStarvedByIO (a GPU no engine reports on: a guess, a ticket) after this long.
    NODE_STARVED_FOR: str = "10m"

    # --- churn: processes crash-loop, restart, get replaced ----------------------------------------------
    # An engine's file and GPU outlive its processes by this long in the joins the alerts make, so that a
    # process restarting (a crash loop's back-off reaches 5 minutes) does not make its engine vanish; and a
    # GPU's compute processes outlive them as long for NodeGPUStarvedByIO (between a crash-looping process's
    # attempts no process holds the GPU), which a GPU whose processes are gone for good stops after this long.
    ENGINE_HOLD: str = "10m"
    # Loads of an engine on one GPU abandoned at least twice within this window (their process exited while
    # loading: killed by its startup probe, out of memory) mean the engine cannot come up: work waits on it
    # although, between attempts, no load is in progress.  Longer than two attempts at the longest back-off.
    LOAD_CRASH_LOOP_WINDOW: str = "15m"
    # After a load is abandoned, its replacement has this long to start loading before the engine stops
    # counting as loading (the first attempts of a crash loop restart within seconds; a drained pod never).
    # Shorter than STORM_PAGE_FOR and STARVED_FOR, so a pod killed once while loading pages nobody.
    LOAD_RESTART_GRACE: str = "1m"
    # A scrape gap (the exporter restarting, OOM-killed or upgraded, its node unreachable) resolves no firing
    # alert of a storm and starts no second one: while the node's exporter has not been up without a break
    # for GAP_SETTLE (its rate windows refilled), a storm or starvation alert that was firing keeps firing
    # on its last judgement, for up to GAP_HOLD.  Longer gaps: GpuioExporterDown.
    GAP_SETTLE: str = "2m"
    GAP_HOLD: str = "10m"

    # --- engine loads ----------------------------------------------------------------------------------
    # A cold start (read + deserialize, the mean of the loads that finished in ENGINE_LOAD_WINDOW) slower
    # than this is slow: engines of a few GB load in seconds from local NVMe or the page cache.
    ENGINE_LOAD_SLOW_SECONDS: float = 60.0
    ENGINE_LOAD_WINDOW: str = "15m"
    SPOOL_ERRORS_WINDOW: str = "15m"

    # --- the exporter itself -------------------------------------------------------------------------
    # A collector that failed in more than this share of its scrapes over COLLECTOR_FAILING_WINDOW.
    # "Most scrapes" rather than "every scrape": a collector that times out every other scrape leaves
    # holes in every rate() and is as broken as one that always fails.
    COLLECTOR_FAILING_RATIO: float = 0.5
    COLLECTOR_FAILING_WINDOW: str = "10m"
    COLLECTOR_FAILING_FOR: str = "5m"
    EXPORTER_DOWN_FOR: str = "5m"

    # --- links (see above) -----------------------------------------------------------------------------
    # runbook_url of an alert: ``{alert}`` is replaced by its name.
    RUNBOOK_URL: str = DEFAULT_RUNBOOK_URL
    # dashboard_url of an alert: this, then /d/<uid>/<uid>?var-...; "" keeps it a path on your Grafana.
    GRAFANA_URL: str = DEFAULT_GRAFANA_URL

    def __post_init__(self) -> None:
        if "{alert}" not in self.RUNBOOK_URL:
            raise ValueError(f"RUNBOOK_URL {self.RUNBOOK_URL!r} must contain {{alert}} (the alert's name)")
        if self.DISK_SOURCE not in DISK_SOURCES:
            raise ValueError(f"DISK_SOURCE {self.DISK_SOURCE!r}: expected one of {', '.join(DISK_SOURCES)}")

    @property
    def thresholds(self) -> thresholds.Thresholds:
        """The numbers `gpuio top` judges its rows by under this config (``gpuio top --set`` takes the same
        names), so the node's screen and the alerts agree under any config, not only the default."""
        return thresholds.Thresholds(**{field.name: getattr(self, field.name)
                                        for field in dataclasses.fields(thresholds.Thresholds)})

    @property
    def from_node_exporter(self) -> bool:
        return self.DISK_SOURCE == NODE_EXPORTER

    def selector(self, *matchers: str) -> str:
        """``{job="gpuio",...}``: the gpuio selector plus more matchers."""
        return "{" + ",".join((self.SELECTOR, *matchers)) + "}"

    def node_exporter_selector(self, *matchers: str) -> str:
        """``{job="node-exporter",...}``: node_exporter's series plus more matchers."""
        return "{" + ",".join((self.NODE_EXPORTER_SELECTOR, *matchers)) + "}"

    def runbook_url(self, alert: str) -> str:
        return self.RUNBOOK_URL.format(alert=alert)

    def dashboard_url(self, uid: str, **variables: str) -> str:
        """A Grafana link to a board with its variables set (values may be alert templates)."""
        query = "&".join(f"var-{name}={value}" for name, value in variables.items())
        return f"{self.GRAFANA_URL.rstrip('/')}/d/{uid}/{uid}" + (f"?{query}" if query else "")


DEFAULT = Config()
KNOBS = frozenset(field.name for field in dataclasses.fields(Config))
# The knobs that are shares (0-1): `--set` refuses more than 1 for them.
RATIO_KNOBS = thresholds.RATIOS | {"BASELINE_MIN_COVERAGE", "STORM_PAGE_IO_FULL", "PCIE_GENERATION_BUSY",
                                   "GPU_ACTIVITY_DROP", "COLLECTOR_FAILING_RATIO", "GPU_ALLOCATED_IDLE_RATIO"}
