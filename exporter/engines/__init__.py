"""The engine path: every source of engine facts feeding one model, which the engines collector renders.

* :mod:`.model` -- the engine model (:class:`~.model.Totals`): per engine, per engine and GPU, loads in
  progress, the waterfall of loads; and :func:`~.model.combined`, how two sources join;
* :mod:`.spool` -- the source of processes that use the library: reading the spool directories and
  files (bounded, untrusted), liveness, deletion of what was folded;
* :mod:`.parse` -- parsing one spool file no one trusts;
* :mod:`.fold` -- adding a file's values up, and a writer's reset;
* :mod:`.discovery` -- the source of processes that do not use the library, from /proc.

The facts about engine files (page-cache residency, the device and mount under a file) are the
exporter's own modules :mod:`exporter.host.pagecache`, :mod:`exporter.host.blockdev` and :mod:`exporter.host.mounts`;
the collector (:mod:`exporter.collectors.engines`) joins the model to them.
"""
