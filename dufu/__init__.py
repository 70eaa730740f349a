"""dufu: write a transformer once for one device; train it in any parallel layout by config."""

__version__ = "0.1.0"


def __getattr__(name):
    # dufu.from_pretrained / dufu.save_pretrained without importing torch-heavy modules at `import dufu`
    if name in ("from_pretrained", "save_pretrained"):
        from dufu.models import hub

        return getattr(hub, name)
    raise AttributeError(f"module 'dufu' has no attribute {name!r}")
