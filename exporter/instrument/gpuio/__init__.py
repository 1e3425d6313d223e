"""gpuio's instrumentation library, imported by inference processes (no web server, no exporter inside).

    import gpuio

    loaded = gpuio.load("/models/detector.pt", lambda data: torch.load(io.BytesIO(data)), device=0)
    pool = gpuio.EnginePool(loaded.metrics, create=lambda: replica(loaded.model), size=4, warmup=warm)
    result = pool.run(lambda model, x: infer_and_sync(model, x), batch, batch_size=len(batch))

    # TensorRT 10/11
    loaded = gpuio.tensorrt.load_engine("/models/resnet50.engine", device=0)
    pool = gpuio.tensorrt.tensorrt_pool(loaded.model, loaded.metrics, size=2, warmup=...)
    with pool.acquire() as runner:
        runner.execute(stream, addresses={...}, batch_size=8)

Metrics go to this process's spool file in ``$GPUIO_SPOOL_DIR`` (default /run/gpuio/spool), which
the node's gpuio-exporter reads (docs/engines.md).  ``tensorrt``, ``pycuda`` and ``torch`` are all
optional: they are used when the process has them.
"""

import os as _os

from . import tensorrt
from .load import Loaded, LoadTimer, engine_name, load, read_file
from .metrics import (
    EngineMetrics,
    EnqueueError,
    Inference,
    PoolTimeout,
    close,
    configure,
    describe,
    engine,
    error_reason,
)
from .pool import EnginePool, Lease

with open(_os.path.join(_os.path.dirname(__file__), "VERSION"), encoding="ascii") as _file:
    __version__ = _file.read().strip()  # the one version gpuio and gpuio-exporter carry

__all__ = [
    "__version__",
    "EngineMetrics",
    "EnginePool",
    "EnqueueError",
    "Inference",
    "Lease",
    "LoadTimer",
    "Loaded",
    "PoolTimeout",
    "close",
    "configure",
    "describe",
    "engine",
    "engine_name",
    "error_reason",
    "load",
    "read_file",
    "tensorrt",
]
