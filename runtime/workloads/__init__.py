"""Workloads for the runtime and the hit-rate studies: synthetic sessions, seeded
traces, model profiles and the cache-only replay."""
