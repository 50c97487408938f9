"""python -m bench.items: what checking a user's own data set item by item costs at 224 px."""
import sys

from bench.items.run import DEFAULT_OUT, OPTIONS, params, run, show  # first: it fixes the threads
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="items", description=sys.modules["bench.items"].__doc__.split("\n\n")[0],
                      options=OPTIONS, params=params, run=run, show=show, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
