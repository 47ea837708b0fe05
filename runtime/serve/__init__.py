"""`s2moe serve`: an OpenAI-compatible HTTP server (app.py) over one decoding worker (worker.py)."""
