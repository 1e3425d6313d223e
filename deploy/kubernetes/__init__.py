"""gpuio on Kubernetes: the kustomization beside this file, and the generator of its rule and dashboard objects."""
