"""User-facing errors.

A :class:`DufuError` is a problem with the user's input (a config key, a file,
a layout) rather than a bug in dufu. The CLI prints its message as one
paragraph, without a traceback, and exits with status 2. The message must say
what is wrong *and* how to fix it.
"""


class DufuError(Exception):
    """An error caused by user input; the message says what is wrong and how to fix it."""


class ConfigError(DufuError):
    """Invalid config: unknown key, wrong type, inconsistent values."""


class DataError(DufuError):
    """Missing, unreadable or corrupt data / tokenizer files."""


class CheckpointError(DufuError):
    """Missing, incomplete or corrupt checkpoints."""


class LayoutError(DufuError):
    """A parallel layout that cannot work (sizes, divisibility, world size)."""


class DistributedFailure(DufuError):
    """A collective failed or timed out: another rank died or hangs. Reported by every rank."""
