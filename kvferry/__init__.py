"""kvferry: cross-model KV-cache translation."""

__version__ = "0.1.0"
