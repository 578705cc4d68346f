"""Benchmarks on real servers: ``omni-ext bench cfg-parallel|data-parallel --json OUT``."""
