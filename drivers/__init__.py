"""Training drivers (``python -m drivers.<name>``; also runnable under ``ray job submit``)."""
