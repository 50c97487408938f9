"""python -m bench.checksums: what the checksums of a finished cache cost, with and without."""
import sys

from bench.checksums.run import DEFAULT_OUT, OPTIONS, params, run, show  # first: it fixes the threads
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="checksums", description=sys.modules["bench.checksums"].__doc__.split("\n\n")[0],
                      options=OPTIONS, params=params, run=run, show=show, default_out=DEFAULT_OUT, threads=None)


if __name__ == "__main__":
    sys.exit(main())
