"""The trainer's errors: one base class, TrainError, which the command prints as one line (exit 2)."""


class TrainError(Exception):
    """A run cannot go on; the message names the cause and the fix."""
