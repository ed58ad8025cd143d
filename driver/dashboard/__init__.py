"""`megascale dashboard`: a local web UI over a job's step timings (server.py, index.html)."""
