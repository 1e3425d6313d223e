"""One module per source.  Importing this package registers every collector."""

from . import diskstats, engines, nvml, pressure, smart  # noqa: F401
