"""The web side: the HTTP server (a fast path for /metrics on uvloop and httptools, FastAPI for the rest),
the JSON API, TLS and basic auth (--web.config.file), the connection bounds and the server's own metrics.
Nothing below it imports it (tests/unit/test_layering.py)."""
