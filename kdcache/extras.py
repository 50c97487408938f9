"""The optional parts of kdcache, and the extra of pyproject.toml that installs each.

kdcache's own dependencies are MXNet, numpy, h5py and tqdm. The rest is imported only where it is used,
through `require`, which turns a missing package into one line naming the extra to install.
"""
import importlib

EXTRAS = {  # importable name -> (distribution, extra)
    "sklearn": ("scikit-learn", "datasets"),
    "mlxtend": ("mlxtend", "datasets"),
    "PIL": ("pillow", "images"),
    "ray": ("ray", "ray"),
}


def missing(name):
    """"DIST, which is not installed: pip install 'kdcache[EXTRA]'" for an importable name of EXTRAS (or a
    module inside one)."""
    dist, extra = EXTRAS[name.partition(".")[0]]
    return f"{dist}, which is not installed: pip install 'kdcache[{extra}]'"


def require(name, what, error):
    """Import module `name` for `what` (the feature that needs it), or raise `error` (an exception class)
    with one line naming the extra that installs it."""
    try:
        return importlib.import_module(name)
    except ImportError:
        raise error(f"{what} needs {missing(name)}") from None
