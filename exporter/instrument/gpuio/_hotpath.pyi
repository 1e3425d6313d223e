"""Types of gpuio/_hotpath.c, the optional C hot path (gpuio.metrics.HOT_PATH says whether it is used)."""

from collections.abc import Callable, Sequence
from types import TracebackType

class Observer:
    """A histogram's observe() over the spool's doubles: the bucket at ``first`` + bisect, the sum after
    the buckets, and the file's generation."""

    def __init__(self, values: memoryview[float], first: int, generation: int, bounds: Sequence[float]) -> None: ...
    def observe(self, value: float) -> None: ...

class Timed:
    """One plain timed inference (from Inferences.infer)."""

    @property
    def latency(self) -> float | None: ...
    def __enter__(self) -> Timed: ...
    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None: ...
    def enqueued(self) -> None: ...

class Inferences:
    """An engine's plain ``with infer():``: in flight up on entry; on success in flight down and the latency
    observed; on an exception ``failed(exc)``."""

    def __init__(self, values: memoryview[float], in_flight: int, first: int, generation: int, bounds: Sequence[float],
                 failed: Callable[[BaseException], None]) -> None: ...
    def infer(self) -> Timed: ...

class Guard:
    """Guard(mapping): a SIGBUS in the mapping (its file was truncated) puts zeroed memory under the
    faulting page and the rest of the mapping, and the store runs again."""

    def __init__(self, mapping: object) -> None: ...
    @property
    def faults(self) -> int: ...
    @property
    def address(self) -> int: ...
    def release(self) -> None: ...

def disown_handles() -> None:
    """After fork(): objects made before now refuse to store."""
