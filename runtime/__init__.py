"""The bundled distributed runtime: a tiny hybrid model, an engine and workloads on HiCache."""
