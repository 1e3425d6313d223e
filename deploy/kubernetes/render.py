"""gpuio's Kubernetes objects for your cluster, from a clean clone: the image you built, the components
you choose, with or without the Prometheus Operator.

    python -m deploy.kubernetes.render --image registry.example/gpuio-exporter:0.1.0 [--component discovery]... \
        [--without-operator] | kubectl apply -f -
    make kubernetes IMAGE=registry.example/gpuio-exporter:0.1.0 COMPONENTS=discovery,residency | kubectl apply -f -

The image is required: this repository publishes none (``make image IMAGE=...`` builds it with Docker or
Podman; push it to a registry your nodes pull from).  It writes a kustomization of its own in a
temporary directory -- the base (deploy/kubernetes) by relative path, the image, the components -- and
prints what ``kubectl kustomize`` builds from it.  ``--without-operator`` leaves out the ServiceMonitor
and the PrometheusRules, whose kinds exist only where the Prometheus Operator's CRDs are installed;
Prometheus then scrapes the exporter with deploy/kubernetes/prometheus-scrape.yml (kubernetes_sd) and
loads deploy/prometheus/rules/*.yml itself.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence

import yaml

HERE = os.path.dirname(os.path.abspath(__file__))
COMPONENTS = sorted(name for name in os.listdir(os.path.join(HERE, "components"))
                    if os.path.isfile(os.path.join(HERE, "components", name, "kustomization.yaml")))
OPERATOR_KINDS = ("ServiceMonitor", "PrometheusRule")


def image_fields(image: str) -> dict[str, str]:
    """A kustomize ``images`` entry's new fields for ``registry/name:tag``, ``registry/name@sha256:...`` or
    ``registry/name`` (tag latest, as a runtime reads it)."""
    if "@" in image:
        name, _, digest = image.partition("@")
        return {"newName": name, "digest": digest}
    name, _, tag = image.rpartition(":")
    if not name or "/" in tag:  # no tag, or the colon was a registry's port
        return {"newName": image, "newTag": "latest"}
    return {"newName": name, "newTag": tag}


def placeholder() -> str:
    """The image name the base kustomization sets (a placeholder that never pulls): what an overlay
    replaces."""
    with open(os.path.join(HERE, "kustomization.yaml")) as handle:
        (image,) = yaml.safe_load(handle)["images"]
    return str(image["newName"])


def kustomization(image: str, components: Sequence[str], base: str) -> dict:
    images = {"name": placeholder(), **image_fields(image)}
    return {"apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": [base], "images": [images],
            "components": [os.path.join(base, "components", component) for component in components]}


def render(image: str, components: Sequence[str], without_operator: bool, kubectl: str) -> str:
    with tempfile.TemporaryDirectory(prefix="gpuio-kubernetes-") as overlay:
        base = os.path.relpath(HERE, overlay)  # kustomize refuses absolute paths
        with open(os.path.join(overlay, "kustomization.yaml"), "w") as handle:
            yaml.safe_dump(kustomization(image, components, base), handle)
        built = subprocess.run([kubectl, "kustomize", overlay], capture_output=True, text=True, timeout=120)
    if built.returncode != 0:
        raise SystemExit(f"render: kubectl kustomize failed: {built.stderr.strip()}")
    if not without_operator:
        return built.stdout
    documents = [doc for doc in yaml.safe_load_all(built.stdout) if doc and doc.get("kind") not in OPERATOR_KINDS]
    return yaml.safe_dump_all(documents, sort_keys=False)


IMAGE_EXAMPLE = "registry.example/gpuio-exporter:0.1.0"


def chosen_components(values: Sequence[str]) -> list[str]:
    """--component values (repeatable, or comma-separated) in the order given, each once; ValueError names
    one that is not a component of components/."""
    chosen = list(dict.fromkeys(part.strip() for value in values for part in value.split(",") if part.strip()))
    unknown = [name for name in chosen if name not in COMPONENTS]
    if unknown:
        raise ValueError(f"no component {', '.join(unknown)}; there are {', '.join(COMPONENTS)}")
    return chosen


def check_image(image: str) -> None:
    """ValueError where ``image`` names no image (empty, or with white space in it)."""
    if not image.strip() or any(ch.isspace() for ch in image):
        raise ValueError(f"--image must name an image, e.g. {IMAGE_EXAMPLE}")


def parse(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m deploy.kubernetes.render",
                                     description="gpuio's Kubernetes objects with your image and components.")
    parser.add_argument("--image", required=True,
                        help="the exporter image your nodes pull, e.g. registry.example/gpuio-exporter:0.1.0 "
                             "(make image IMAGE=... builds it; none is published)")
    parser.add_argument("--component", action="append", default=[],
                        help="an opt-in component (repeatable, or comma-separated): " + ", ".join(COMPONENTS))
    parser.add_argument("--without-operator", action="store_true",
                        help="leave out the ServiceMonitor and PrometheusRules (no Prometheus Operator CRDs)")
    parser.add_argument("--kubectl", default=shutil.which("kubectl") or "kubectl",
                        help="kubectl, with its built-in kustomize (default: from PATH)")
    args = parser.parse_args(argv)
    try:
        args.component = chosen_components(args.component)
    except ValueError as error:
        parser.error(str(error))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else argv)
    try:
        check_image(args.image)
    except ValueError as error:
        print(f"render: error: {error}", file=sys.stderr)
        return 2
    if shutil.which(args.kubectl) is None:
        print(f"render: error: {args.kubectl} not found: install kubectl (it builds kustomizations)", file=sys.stderr)
        return 2
    sys.stdout.write(render(args.image, args.component, args.without_operator, args.kubectl))
    return 0


if __name__ == "__main__":
    sys.exit(main())
