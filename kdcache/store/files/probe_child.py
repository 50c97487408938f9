"""The child process of store.files.probe: reads an unsealed finished cache file as a reader would, and says how
it went by its exit status (probe.OK, probe.REFUSED, probe.REFUSED_OURS) and one line on stderr."""
import os
import sys

from . import probe
from ..format import schema
from ..errors import NewerFormatError, StoreError


def _read_all(path, stage):
    """What a reader reads of a finished file before its rows: every check store.files.segment.final_spec
    makes, every dataset's shape, type and attributes. `stage` records how far it got."""
    from .segment import final_spec
    from .segment import open_final
    with open_final(path) as f:
        stage["ours"] = schema.A_FORMAT in f.attrs  # an HDF5 file with kdcache's metadata: a cache, damaged or not
    final_spec(path, os.path.basename(path)[:-3] if path.endswith(".h5") else None)
    with open_final(path) as f:
        for k in f.keys():
            f[k].shape, f[k].dtype, dict(f[k].attrs)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    probe.CHILD = True  # this process's own opens read the file directly
    stage = {"ours": False}
    try:
        _read_all(argv[0], stage)
    except NewerFormatError as e:
        print(f"newer: {str(e).splitlines()[0]}", file=sys.stderr)
        return probe.REFUSED
    except Exception as e:  # noqa: BLE001 -- whatever HDF5 raises: one line, the parent decides
        line = str(e).splitlines()[0] if str(e) else ""
        if not isinstance(e, StoreError):
            line = (f"{argv[0]}: unreadable ({type(e).__name__}: {line[:160]}): remove it (kdcache gc removes "
                    f"damaged caches) and rebuild it")
        print(line, file=sys.stderr)
        return probe.REFUSED_OURS if stage["ours"] else probe.REFUSED
    return probe.OK


if __name__ == "__main__":
    sys.exit(main())
