"""Fuzz gpuio's C hot path (gpuio/_hotpath.c) against the Python one: any sequence of values, of any
kind a caller may pass, leaves the same doubles in the spool through either.

Each example observes the same generated values into two fresh mappings, one through
``_hotpath.Observer`` and one through the Python closure the library uses where C is not built, with
generated bounds (any increasing finite floats) and generated slots, and compares the mappings double
for double (NaN equal to NaN, -0.0 told from 0.0), or, for a value neither accepts, the same exception.
"""

from __future__ import annotations

import math
import mmap
import struct
from collections.abc import Callable

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gpuio import metrics
from gpuio import spool as spool_format
from tests.conftest import c_path_can_be_built

DOUBLES = 256

if metrics._hotpath is None:
    assert not c_path_can_be_built(), "gpuio._hotpath is not built: pip install -e ./exporter/instrument"
    pytest.skip("gpuio._hotpath cannot be built here", allow_module_level=True)

values_strategy = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-(2**70), max_value=2**70),  # past a double's exact range, and past float()'s
    st.booleans(),
    st.fractions(max_denominator=10**6),
    st.sampled_from([0.0, -0.0, 5e-324, -5e-324, 1.7976931348623157e308]),
)
bounds_strategy = st.lists(st.floats(allow_nan=False, allow_infinity=False, width=64), max_size=24,
                           unique=True).map(sorted)


def python_observer(values: memoryview, first: int, bounds: tuple[float, ...]) -> Callable[[float], None]:
    """The library's Python observe() over ``values`` (the closure Histogram._observer builds)."""
    handle = metrics.Histogram.__new__(metrics.Histogram)
    handle._values, handle._first, handle._sum, handle._bounds = values, first, first + len(bounds) + 1, bounds
    return handle._observer()


def outcome(observe: Callable[[object], None], value: object) -> str | None:
    try:
        observe(value)
    except (TypeError, ValueError, OverflowError) as error:
        return type(error).__name__
    return None


@given(bounds=bounds_strategy, first=st.integers(min_value=spool_format.GENERATION_INDEX + 1, max_value=DOUBLES - 26),
       data=st.data())
def test_c_and_python_observe_store_the_same(bounds: list[float], first: int, data: st.DataObject) -> None:
    # Values exactly on a bound too: where a bisect that is one comparison off would differ.
    on_bounds = st.sampled_from(bounds) if bounds else st.nothing()
    observed = data.draw(st.lists(st.one_of(values_strategy, on_bounds), max_size=40))
    c_map, python_map = mmap.mmap(-1, DOUBLES * 8), mmap.mmap(-1, DOUBLES * 8)
    c_values, python_values = memoryview(c_map).cast("d"), memoryview(python_map).cast("d")
    c_observe = metrics._hotpath.Observer(c_values, first, spool_format.GENERATION_INDEX, tuple(bounds)).observe
    python_observe = python_observer(python_values, first, tuple(bounds))
    for value in observed:
        assert outcome(c_observe, value) == outcome(python_observe, value), value
        assert c_map[:] == python_map[:], value  # bytes: NaN payloads, -0.0 and all
    count = sum(1 for value in observed if not (isinstance(value, float) and math.isnan(value))
                and outcome(float, value) is None)
    assert struct.unpack_from("<d", c_map, spool_format.GENERATION_OFFSET)[0] == count
    del c_observe
    c_values.release()
    python_values.release()
