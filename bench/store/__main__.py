"""python -m bench.store: the store benchmark's command, through the benchmarks' one main routine."""
import sys

from bench.store.run import DEFAULT_OUT, DESCRIPTION, OPTIONS, params, run, show  # first: it fixes the threads
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="store", description=DESCRIPTION, options=OPTIONS, params=params, run=run,
                      show=show, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
