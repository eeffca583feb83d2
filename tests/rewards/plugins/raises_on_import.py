"""Fails while being imported."""

raise RuntimeError("plugin module is broken")
