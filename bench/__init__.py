"""Benchmarks (``python -m bench.<name>``); they report ratios measured side by side."""
