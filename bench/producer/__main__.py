"""python -m bench.producer: the producer benchmark's command, through the benchmarks' one main routine."""
import sys

from bench.producer.run import DEFAULT_OUT, DESCRIPTION, OPTIONS, THREADS, params, run, show  # first: nothing loads MXNet
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="producer", description=DESCRIPTION, options=OPTIONS, params=params, run=run,
                      show=show, default_out=DEFAULT_OUT, threads=THREADS)


if __name__ == "__main__":
    sys.exit(main())
