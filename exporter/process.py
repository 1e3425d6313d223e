"""The exporter's own process_* metrics (the names client_golang and client_python use).

Read from the exporter's own /proc/self, not from --path.procfs (that is the host's view).
"""

from __future__ import annotations

import os
import resource

from .exposition import COUNTER, GAUGE, Desc, Family
from .host import procstat
from .host.procstat import START_TIME, stat_fields

CPU = Desc("process_cpu_seconds_total", COUNTER, "Total user and system CPU time spent in seconds.", unit="seconds")
RSS = Desc("process_resident_memory_bytes", GAUGE, "Resident memory size in bytes.", unit="bytes")
VSIZE = Desc("process_virtual_memory_bytes", GAUGE, "Virtual memory size in bytes.", unit="bytes")
START = Desc("process_start_time_seconds", GAUGE,
             "Start time of the process since unix epoch in seconds.", unit="seconds")
OPEN_FDS = Desc("process_open_fds", GAUGE, "Number of open file descriptors.")
MAX_FDS = Desc("process_max_fds", GAUGE, "Maximum number of open file descriptors.")
THREADS = Desc("process_threads", GAUGE, "Number of OS threads in the process.")

_TICKS = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")


def _boot_time() -> float:
    with open("/proc/stat") as handle:
        for line in handle:
            if line.startswith("btime "):
                return float(line.split()[1])
    return 0.0


class ProcessMetrics:
    def __init__(self) -> None:
        self._start = _boot_time() + int(stat_fields()[START_TIME]) / _TICKS
        self._max_fds = resource.getrlimit(resource.RLIMIT_NOFILE)[0]

    def families(self) -> list[Family]:
        stat = stat_fields()
        return [
            Family(CPU, [CPU.sample("", (int(stat[procstat.UTIME]) + int(stat[procstat.STIME])) / _TICKS)]),
            Family(RSS, [RSS.sample("", int(stat[procstat.RSS]) * _PAGE)]),
            Family(VSIZE, [VSIZE.sample("", int(stat[procstat.VSIZE]))]),
            Family(START, [START.sample("", self._start)]),
            Family(OPEN_FDS, [OPEN_FDS.sample("", len(os.listdir("/proc/self/fd")))]),
            Family(MAX_FDS, [MAX_FDS.sample("", self._max_fds)]),
            Family(THREADS, [THREADS.sample("", int(stat[procstat.THREADS]))]),
        ]
