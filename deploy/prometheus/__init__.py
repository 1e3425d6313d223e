"""gpuio's Prometheus rules and alerts, generated from config.py (see generate.py)."""
