"""gpuio on this machine without Docker: exporter, Prometheus and Alertmanager (deploy/local/stack.py)."""
