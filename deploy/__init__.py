"""gpuio's generated deploy files and their generators (rules, boards, runbooks, Kubernetes objects).

Shipped in the exporter's wheel as gpuio_exporter.deploy, so `gpuio generate` runs from an install; in a checkout
it is this folder, `python -m deploy.generate`."""
