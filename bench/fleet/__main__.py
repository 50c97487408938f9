"""python -m bench.fleet: the many-hosts benchmark's command, through the benchmarks' one main routine."""
import sys

from bench.fleet.run import DEFAULT_OUT, DESCRIPTION, OPTIONS, params, run, show  # first: nothing loads MXNet
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="fleet", description=DESCRIPTION, options=OPTIONS, params=params, run=run,
                      show=show, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
