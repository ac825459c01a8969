"""The exact response cache's pure parts: which requests may be cached and their key (``key.py``), and
an entry's stored form (``entry.py``). The worker's side (Valkey, replay, coalescing) is
workers/response_cache.py; docs/cache.md explains the behaviour."""
