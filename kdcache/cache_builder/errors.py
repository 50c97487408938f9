"""The producer's errors: one base class, ProducerError, printed as one line (exit 2)."""
from kdcache.errors import KdcacheError


class ProducerError(KdcacheError, ValueError):
    """The producer cannot go on as asked; the message names the cause and the fix."""
