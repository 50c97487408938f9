"""The pipeline's errors: one base class, PipelineError, a ValueError the commands print as one line (exit 2)."""
from kdcache.errors import KdcacheError


class PipelineError(KdcacheError, ValueError):
    """A data set, a teacher checkpoint or an augmentation cannot be used as given; the message
    names the cause and the fix."""
