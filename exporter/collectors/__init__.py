"""One module per source.  Importing this package registers every collector."""

from . import diskstats, engines, pressure  # noqa: F401
