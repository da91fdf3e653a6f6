"""Helpers no user should import directly."""
