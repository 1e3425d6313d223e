"""One module per source.  Importing this package registers every collector."""

from . import diskstats, engines, nvml, pressure  # noqa: F401
