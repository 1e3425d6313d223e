"""Kubernetes pod attribution: which pod and container a process, a GPU and an engine belong to.

Three sources, each the one that knows (docs/deploy.md, "Pods"):

* :mod:`.cgroup`: a process's pod UID and container ID, from ``/proc/<pid>/cgroup`` (the kernel's);
* :mod:`.podresources`: which namespace/pod/container holds each GPU, from the kubelet's pod-resources
  API (device plugins and DRA), polled in the background;
* :mod:`.kubelet`: spool directories in pods' emptyDir volumes, from the kubelet's pods directory (the
  pod UID is in the path); the pod's names come from the writer's Downward API environment, which the
  instrumentation library records in its spool file.
"""
