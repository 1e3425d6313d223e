"""What a person runs on a node: `gpuio engines`, `gpuio warm`, `gpuio top`, and the client of a remote
exporter they share; the entry point (exporter/cli.py) dispatches to them."""
