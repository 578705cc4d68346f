"""Model-building helpers (tiny random-weight pipelines for tests and CPU benchmarks)."""
