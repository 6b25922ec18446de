"""The checkpoint errors, apart from the code that raises them: catching one needs no torch."""


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or read; the message says which and why."""


class StaleWriterError(CheckpointError):
    """A newer worker group has started: this (stale) group may not commit."""
