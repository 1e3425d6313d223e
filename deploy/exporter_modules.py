"""The exporter's modules the generators read -- its thresholds and its option parsing -- under either of
its names: ``gpuio_exporter`` where the wheel installs deploy/ inside it (``gpuio generate``), ``exporter``
in a checkout, where deploy/ sits beside exporter/ (``python -m deploy.generate``).  The one place deploy/
reaches into the exporter."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from exporter import options, thresholds
else:
    def _module(name: str) -> ModuleType:
        installed = (__package__ or "").rpartition(".")[0]  # "gpuio_exporter" in the wheel, "" in a checkout
        return importlib.import_module(f"{installed}.{name}" if installed else f"exporter.{name}")

    options, thresholds = _module("options"), _module("thresholds")

__all__ = ["options", "thresholds"]
