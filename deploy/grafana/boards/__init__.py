"""gpuio's Grafana dashboards, generated from Python with grafana-foundation-sdk.

Each board is a function of the one ``Config`` the rules are generated from (deploy/prometheus/config.py),
so the thresholds, windows and selectors a panel shows are the ones its alerts use under any config.
The JSON goes to the repository's dashboards/ folder, which Grafana (or its sidecar) loads.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from grafana_foundation_sdk.builders.dashboard import Dashboard

from ...generated import DASHBOARDS_DIR
from ...prometheus.config import (
    DASHBOARD_TITLES,
    DEFAULT,
    DISK_HEALTH_UID,
    DISK_IO_UID,
    ENGINES_UID,
    GPU_UID,
    STARVATION_UID,
    Config,
)
from . import disk_health, disk_io, engines, fleet, gpu, starvation
from .common import render

# uid -> the function that builds it under a config; the JSON is dashboards/<uid>.json.
BOARDS: dict[str, Callable[[Config], Dashboard]] = {
    DISK_IO_UID: disk_io.build,
    STARVATION_UID: starvation.build,
    GPU_UID: gpu.build,
    ENGINES_UID: engines.build,
    DISK_HEALTH_UID: disk_health.build,
    fleet.FLEET_UID: fleet.build,
}
# uid -> title, of every board
TITLES = {**DASHBOARD_TITLES, fleet.FLEET_UID: fleet.FLEET_TITLE}


def rendered(config: Config = DEFAULT, directory: str = DASHBOARDS_DIR) -> dict[str, str]:
    """Path of each dashboard's JSON under ``directory`` -> its text under ``config``."""
    return {os.path.join(directory, f"{uid}.json"): render(build(config)) for uid, build in BOARDS.items()}
