"""The JSON API: ``GET /api/v1/engines``, the engine join ``gpuio engines`` prints, from the running exporter.

So that the engineer without a shell on the node (``gpuio engines --url https://node7:9817``) sees what
the one with a shell sees: each engine file with its spool figures, loads in progress, predicted cold
start, and the disk, mount, GPU and pod behind it (docs/engines.md, "The JSON API").  The rows are
:class:`exporter.engine_join.EngineJoin`'s, the same function ``gpuio engines`` prints, made from the
exporter's own engine service (exporter.engines.service, which its engines collector renders): the
spool read once, as a scrape reads it, and the background scan's last answer for the engine files (the
residency /metrics serves; no file is measured for a request).

Served by FastAPI, which the server loads with the first request off its fast path, behind the same
guard as /metrics (TLS, basic auth, configured headers: exporter/web/webconfig.py wraps the whole app).

Bounded, whoever asks and however often:

* the rows: at most the collector's ``--collector.engines.max-engines`` engines (those with live
  processes first), MAX_INFOS files each, MAX_GPUS_PER_ENGINE GPUs and MAX_PODS_PER_ENGINE pods a row
  (the collector's own caps), and at most MAX_ANSWER_BYTES of rows; what is left out is counted in the
  answer;
* the work: one request is answered at a time, on a thread of its own, with the collector's lock held
  (a scrape waits for it as for a second scrape, and an answer waits at most LOCK_WAIT_SECONDS for a
  scrape); one more may wait; beyond that, 503 at once.

Errors are JSON, FastAPI's ``{"detail": "..."}``; a 401 or 429 from the guard is its plain text, as on
/metrics.  No OpenAPI document or docs page is served (see exporter/web/server.py); ``python -m exporter.web.api``
prints the document.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from threading import BoundedSemaphore
from typing import TYPE_CHECKING, Any, cast

from fastapi import APIRouter, FastAPI, HTTPException
from pydantic import BaseModel, Field

from .. import __version__
from ..engine_join import ENGINES_API, EngineJoin, finite
from ..engines.files import MAX_INFOS
from ..engines.service import MAX_GPUS_PER_ENGINE, MAX_PODS_PER_ENGINE

if TYPE_CHECKING:
    from ..collect import CollectorState, Scraper
    from ..collectors.engines import EnginesCollector

log = logging.getLogger("gpuio.api")

MAX_ANSWER_BYTES = 8 << 20  # of rows, as JSON: ~3,000 rows of 2.5 KiB, far above the engine caps' usual need
LOCK_WAIT_SECONDS = 5.0  # for the engines collector, which a scrape may hold (its budget is the scrape timeout)
MAX_WAITING = 1  # requests queued behind the one being answered


class EngineRow(BaseModel):
    """One engine file (or one engine with no file known): a line of ``gpuio engines``."""

    engine: str = Field(description="The engine's name (the library's, or discovery's: the model's)")
    path: str = Field(description="The engine file; empty when none is known")
    processes: int = Field(description="Live processes reporting the engine (library and discovery)")
    pods: list[str] = Field(description="namespace/pod of the processes reporting it")
    size_bytes: int | None = Field(description="The file's size")
    cached_ratio: float | None = Field(description="Share of the file in the page cache, 0 to 1, at the last scan")
    residency_unavailable: str | None = Field(description="Why there is no cached_ratio")
    device: str = Field(description="The block device under the file (e.g. dm-0); empty when not known")
    disks: list[str] = Field(description="The whole disks under that device")
    mountpoint: str | None = Field(description="The mount point the file is under")
    fstype: str | None = Field(description="That mount's file system type")
    gpus: list[str] = Field(description='GPUs the engine was loaded on from this file: "cuda:N GPU-uuid"')
    loads: float | None = Field(description="Finished loads (spool), all processes")
    read_mib_per_second: float | None = Field(description="Mean read throughput of those loads")
    inferences: float | None = Field(description="Inferences (spool), all processes")
    mean_latency_seconds: float | None = Field(description="Mean inference latency")
    loads_in_progress: float = Field(description="Loads started and not finished by live processes, all GPUs")
    load_in_progress_read_bytes: float = Field(description="Bytes those loads have read so far")
    load_in_progress_since: float | None = Field(description="Unix time the oldest of them began")
    last_load_timestamp: float | None = Field(description="Unix time of the latest finished load")
    last_load_class: str | None = Field(description="cold, warm or partial: where that load's bytes came from")
    last_load_seconds: float | None = Field(description="That load's wall time")
    last_load_phases: dict[str, float] | None = Field(description="Its waterfall: seconds per phase")
    last_load_device_bytes: float | None = Field(description="Its bytes read from the disk")
    last_load_cache_bytes: float | None = Field(description="Its bytes read from the page cache")
    last_load_read_bytes_per_second: float | None = Field(description="Its read throughput")
    predicted_cold_start_seconds: float | None = Field(
        description="Bytes not cached now / cold-read throughput + mean deserialize time (docs/engines.md)")


class EnginesAnswer(BaseModel):
    """Every engine the exporter knows, within its bounds, and what they left out."""

    engines: list[EngineRow] = Field(description="Sorted by engine, then path")
    generated_at: float = Field(description="Unix time the rows were made")
    files_scanned_at: float | None = Field(description="Unix time of the scan sizes and residency come from")
    collector_state: str | None = Field(
        description="The engines collector at the last scrape: ok, pending, absent, failing or stale; null before "
                    "the first")
    collector_reason: str | None = Field(description="Why, when it is not ok")
    max_engines: int = Field(description="--collector.engines.max-engines: at most this many engines are listed")
    engines_left_out: int = Field(description="Engines over max_engines, not listed")
    rows_left_out: int = Field(description="Files of listed engines over the per-engine or the answer's bound")


class Problem(BaseModel):
    detail: str


class EnginesReport:
    """Makes the answer from the exporter's engines collector, one request at a time (module note)."""

    def __init__(self, scraper: Scraper | None) -> None:
        self.scraper = scraper
        self.state = scraper.states.get("engines") if scraper is not None else None
        self._slots = BoundedSemaphore(1 + MAX_WAITING)
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="gpuio-api")

    async def answer(self) -> dict[str, Any]:
        if self.state is None:
            raise HTTPException(404, "the engines collector is not enabled on this exporter (--collector.engines)")
        if not self._slots.acquire(blocking=False):
            raise HTTPException(503, "busy answering other requests for the engines; retry", {"Retry-After": "1"})
        try:
            await self._scraped_once(self.state)
            work = self._worker.submit(self._locked_answer, self.state)
        except BaseException:
            self._slots.release()
            raise
        # The slot is given back when the work ends, not when the request does: a client that leaves
        # cannot make room for more work than one thread does.
        work.add_done_callback(lambda _: self._slots.release())
        return await asyncio.wrap_future(work)

    async def _scraped_once(self, state: CollectorState) -> None:
        """An exporter nobody has scraped yet scrapes its engines collector once (as the landing page
        does): a scrape is what learns the files processes report, which the background scan then
        measures."""
        if state.last_state is None and self.scraper is not None:
            await self.scraper.scrape([state.collector.name])

    def _locked_answer(self, state: CollectorState) -> dict[str, Any]:
        if not state.lock.acquire(timeout=LOCK_WAIT_SECONDS):
            raise HTTPException(503, f"the engines collector has been busy for {LOCK_WAIT_SECONDS:g} s (a slow "
                                     "scrape?); retry", {"Retry-After": "5"})
        try:
            return self._make(cast("EnginesCollector", state.collector), state)
        except Exception:
            log.exception("engines API answer failed")
            raise HTTPException(500, "reading the engines failed; the exporter's log says why") from None
        finally:
            state.lock.release()

    def _make(self, collector: EnginesCollector, state: CollectorState) -> dict[str, Any]:
        service = collector.service
        scan = service.files.last_scan()
        join = EngineJoin(service, service.totals_now(), dict(scan.files) if scan else {}, look_up=False)
        engines = join.engines()
        shown = sorted(_ranked(join, engines)[:service.max_engines])
        rows, rows_left_out = _bounded_rows(join, shown)
        return {
            "engines": rows, "generated_at": time.time(),
            "files_scanned_at": scan.finished if scan else None,
            "collector_state": state.last_state, "collector_reason": state.last_error,
            "max_engines": service.max_engines, "engines_left_out": len(engines) - len(shown),
            "rows_left_out": rows_left_out,
        }


def _ranked(join: EngineJoin, engines: list[str]) -> list[str]:
    """Engines with live processes first (what on-call asks about), then the rest; by name within each."""
    return sorted(engines, key=lambda engine: (join.totals.live_processes(engine) == 0, engine))


def _bounded_rows(join: EngineJoin, engines: list[str]) -> tuple[list[dict[str, Any]], int]:
    """The engines' rows within the per-engine caps and MAX_ANSWER_BYTES, and how many were left out.
    Figures that are no finite number (a writer's absurd counts) become null: JSON has no Infinity."""
    rows: list[dict[str, Any]] = []
    left_out = 0
    size = 0
    for engine in engines:
        paths = join.paths(engine)
        left_out += max(0, len(paths) - MAX_INFOS)
        for path in paths[:MAX_INFOS]:
            if size > MAX_ANSWER_BYTES:
                left_out += 1  # counted, not made: the answer is full
                continue
            row = finite(join.row(engine, path))
            row["gpus"], row["pods"] = row["gpus"][:MAX_GPUS_PER_ENGINE], row["pods"][:MAX_PODS_PER_ENGINE]
            size += len(json.dumps(row))  # escaped as ASCII: never shorter than the answer's UTF-8
            if size > MAX_ANSWER_BYTES:
                left_out += 1
            else:
                rows.append(row)
    return rows, left_out


def engines_router(scraper: Scraper | None) -> APIRouter:
    """The API's routes, answered from ``scraper``'s engines collector."""
    report = EnginesReport(scraper)
    router = APIRouter()
    problems: dict[int | str, dict[str, Any]] = {
        404: {"model": Problem, "description": "The engines collector is off"},
        503: {"model": Problem, "description": "Busy: retry after Retry-After seconds"},
        500: {"model": Problem, "description": "The engines could not be read"},
    }

    @router.get(ENGINES_API, response_model=EnginesAnswer, responses=problems,
                summary="The engines on this node, joined to their files, disks, mounts, GPUs and pods")
    async def engines() -> dict[str, Any]:
        return await report.answer()

    return router


def openapi_document() -> dict[str, Any]:
    """The API's OpenAPI document (not served: see the module note)."""
    app = FastAPI(title="gpuio-exporter", version=__version__)
    app.include_router(engines_router(None))
    return app.openapi()


if __name__ == "__main__":
    print(json.dumps(openapi_document(), indent=2))
