"""python -m bench.publish: a published cache pulled from a real nginx, against curl; a resume; ImageNet-1k's size."""
import sys

from bench.publish.run import DEFAULT_OUT, OPTIONS, params, run, show  # first: it fixes the threads
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="publish", description=sys.modules["bench.publish"].__doc__.split("\n\n")[0],
                      options=OPTIONS, params=params, run=run, show=show, default_out=DEFAULT_OUT, threads=None)


if __name__ == "__main__":
    sys.exit(main())
