"""One module per source.  Importing this package registers every collector."""

from . import diskstats, pressure  # noqa: F401
