"""python -m bench.read_scale: the read_scale benchmark's command, through the benchmarks' one main routine."""
import sys

from bench.read_scale.run import DEFAULT_OUT, DESCRIPTION, OPTIONS, params, run, show  # first: it fixes the threads
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="read_scale", description=DESCRIPTION, options=OPTIONS, params=params, run=run,
                      show=show, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
