"""kdcache trainer: the student trained on cached soft targets.

MXNet is imported lazily (PEP 562): `python -m kdcache.trainer` must fix OMP_NUM_THREADS first.
"""


def __getattr__(name):
    if name in ("SoftTargetIter", "kd_symbol"):
        from . import dataiter
        return getattr(dataiter, name)
    if name == "SoftTargetDataset":
        from . import softdata
        return softdata.SoftTargetDataset
    raise AttributeError(f"module 'trainer' has no attribute {name!r}")
