"""One module per source.  Importing this package registers every collector."""

from . import cgroup_io, diskstats, engines, mountstats, nvml, pods, pressure, smart  # noqa: F401
