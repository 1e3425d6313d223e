"""gpuio's Grafana boards (boards/) and Grafana's provisioning of them (provisioning/)."""
