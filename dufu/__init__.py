"""dufu: write a transformer once for one device; train it in any parallel layout by config."""

__version__ = "0.1.0"


def __getattr__(name):
    # dufu.from_pretrained / save_pretrained / pretrained_model without importing torch-heavy modules at `import dufu`
    if name in ("from_pretrained", "pretrained_model", "save_pretrained"):
        from dufu.engine.weights import pretrained  # torch: only when one of them is used, not at `import dufu`

        return getattr(pretrained, name)
    raise AttributeError(f"module 'dufu' has no attribute {name!r}")
