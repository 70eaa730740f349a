"""dufu: write a transformer once for one device; train it in any parallel layout by config."""

__version__ = "0.1.0"
