"""`kvray serve`: an OpenAI-compatible server on Ray Serve over the engine replicas (see app.py)."""
