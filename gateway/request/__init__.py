"""Sans-IO steps of one proxied request: header scan, attempt bookkeeping, quota settlement."""
