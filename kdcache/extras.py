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
    with one line naming the extra that installs it: "not installed" when its package is absent, else the
    import's own reason (a package that is there but breaks on import, as Ray beside pyarrow 26 does)."""
    try:
        return importlib.import_module(name)
    except ImportError as e:
        top = name.partition(".")[0]
        if isinstance(e, ModuleNotFoundError) and e.name == top:
            raise error(f"{what} needs {missing(name)}") from None
        dist, extra = EXTRAS[top]
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise error(f"{what} needs {dist}, which cannot be imported here ({reason}): pip install "
                    f"'kdcache[{extra}]'") from None
