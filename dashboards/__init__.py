"""gpuio's Grafana dashboards, generated from Python with grafana-foundation-sdk (see __main__.py)."""

from __future__ import annotations

import os
from collections.abc import Callable

from grafana_foundation_sdk.builders.dashboard import Dashboard

from deploy.prometheus import config

from . import disk_health, disk_io, engines, fleet, gpu, starvation
from .common import render

HERE = os.path.dirname(os.path.abspath(__file__))

# uid -> the function that builds it; the JSON lies beside this file as <uid>.json.
BOARDS: dict[str, Callable[[], Dashboard]] = {
    config.DISK_IO_UID: disk_io.build,
    config.STARVATION_UID: starvation.build,
    config.GPU_UID: gpu.build,
    config.ENGINES_UID: engines.build,
    config.DISK_HEALTH_UID: disk_health.build,
    fleet.FLEET_UID: fleet.build,
}
# uid -> title, of every board
TITLES = {**config.DASHBOARD_TITLES, fleet.FLEET_UID: fleet.FLEET_TITLE}


def rendered() -> dict[str, str]:
    """Path of each dashboard's JSON -> its generated text."""
    return {os.path.join(HERE, f"{uid}.json"): render(build()) for uid, build in BOARDS.items()}
