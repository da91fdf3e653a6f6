"""The library's version: written into every checkpoint's ``version.json``."""

__version__ = "0.2.0"
