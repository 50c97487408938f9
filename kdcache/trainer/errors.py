"""The trainer's errors: one base class, TrainError, which the command prints as one line (exit 2)."""
from kdcache.errors import KdcacheError


class TrainError(KdcacheError):
    """A run cannot go on; the message names the cause and the fix."""


class BadValueError(TrainError, ValueError):
    """A value the trainer's API cannot use (a negative epoch, a data set of another length than its cache, an
    iterator without sample indices, an unknown network): a ValueError too, as it was."""
