"""``gpuio top``: one terminal screen of this node's disks, GPUs and engines, judged as the alerts judge.

Data path: a *source* yields snapshots (every sample of one scrape, parsed from the text exposition
with prometheus_client's parser), either in-process through the exporter's own collectors (the same
``build_scraper`` the server uses, so the same flags: ``--path.procfs``, ``--collector.*``) or from a
running exporter (``--url``).  Two consecutive snapshots give one :class:`View`: iostat -x figures per
device, PSI rates, GPU busy ratio from the busy-seconds counter, engine latency quantiles from histogram
buckets.  Everything is keyed on metric names, all listed in one block below, so a collector that
lands later (nvml, engines) shows up without code here, and a renamed metric is a one-line change.

Judgements (highlight, flags) come from :mod:`exporter.thresholds`, the numbers the alert rules use.

The screen is drawn with rich (Live on the alternate screen); keys are read from the terminal in
cbreak mode with select(), so nothing here writes an escape sequence of its own.

Three modules, each using only the ones before it: :mod:`.data` (the names read, snapshots, sources),
:mod:`.iostat` (the arithmetic and judgements) and :mod:`.display` (the screen and the command line).
"""

from .display import main

__all__ = ["main"]
