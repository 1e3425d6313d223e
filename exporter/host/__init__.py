"""The host's readers and parsers: /proc, /sys, mount tables, page-cache residency, smartctl, NVML's
device calls; below the collector framework and the web stack, so each is usable (and fuzzed) alone."""
