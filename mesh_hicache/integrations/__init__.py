"""Adapters that run the cache inside other serving engines (each imports its engine only in
its own sub-package)."""
