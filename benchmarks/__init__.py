"""Benchmarks behind the thin command lines in ``scripts/`` (figures in the README)."""
