"""One module per source.  Importing this package registers every collector."""

from . import diskstats, engines, mountstats, nvml, pressure, smart  # noqa: F401
