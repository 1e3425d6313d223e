"""The engine service and its sources: every fact about engines, joined into one snapshot that the engines
collector, ``gpuio engines`` and ``GET /api/v1/engines`` render.

* :mod:`.service` -- the engine service: owns the sources below and hands out snapshots;
* :mod:`.model` -- the engine model (:class:`~.model.Totals`): per engine, per engine and GPU, loads in
  progress, the waterfall of loads; and :func:`~.model.combined`, how two sources join;
* :mod:`.spool` -- the source of processes that use the library: reading the spool directories and
  files (bounded, untrusted), liveness, deletion of what was folded (its parts: ``spool_*``);
* :mod:`.parse` -- parsing one spool file no one trusts; :mod:`.fold` -- adding a file's values up;
* :mod:`.discovery` -- the source of processes that do not use the library, from /proc (placed on GPUs
  by :mod:`.placing` and :mod:`.placement`);
* :mod:`.files` -- the engine files: size, page-cache residency, the device and mount under each (read
  through :mod:`exporter.host.pagecache`, :mod:`exporter.host.blockdev`, :mod:`exporter.host.mounts`);
* :mod:`.selection` -- which engines are shown under the cap, shared fairly among tenants.
"""
