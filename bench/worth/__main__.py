"""python -m bench.worth: what the cache buys at equal compute, on the full Fashion-MNIST."""
import sys

from bench.worth.run import DEFAULT_OUT, OPTIONS, params, run, show  # first: it fixes the threads
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="worth", description=sys.modules["bench.worth"].__doc__.split("\n\n")[0],
                      options=OPTIONS, run=run, show=show, params=params, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
