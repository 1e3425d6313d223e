"""The PSI line format (Documentation/accounting/psi.rst), shared by the node's /proc/pressure files
(collectors/pressure.py) and each cgroup's io.pressure (cgroups.py):

    some avg10=0.00 avg60=0.00 avg300=0.00 total=123456
    full avg10=0.00 avg60=0.00 avg300=0.00 total=123456
"""

from __future__ import annotations

from .lines import BadLine
from .procstat import whole_number


def parse_total(line: str) -> tuple[str, int]:
    """``("some"|"full", total microseconds)`` of one PSI line; BadLine otherwise (fields in any order)."""
    kind, _, rest = line.partition(" ")
    if kind not in ("some", "full"):
        raise BadLine("unknown_kind", "line starts with neither 'some' nor 'full'")
    for item in rest.split():
        key, _, value = item.partition("=")
        if key == "total":
            total = whole_number(value)
            if total is None:
                raise BadLine("non_numeric", "total is not a non-negative integer of at most 20 digits")
            return kind, total
    raise BadLine("no_total", "no total=")
