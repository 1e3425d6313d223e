"""gpuio: is this GPU idle because its engine or its data cannot come off the disk fast enough?"""

import importlib.util as _util
import os as _os


def _version() -> str:
    """The version both distributions carry: gpuio's VERSION file (exporter/instrument/gpuio/VERSION),
    found beside the library without importing it (the exporter requires that very version of it)."""
    spec = _util.find_spec("gpuio")
    if spec is None or spec.origin is None:
        return "unknown"
    try:
        with open(_os.path.join(_os.path.dirname(spec.origin), "VERSION"), encoding="ascii") as file:
            return file.read().strip()
    except OSError:
        return "unknown"


__version__ = _version()
