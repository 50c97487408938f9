"""python -m bench.sizing: ImageNet-1k sizing, bytes per view per codec and teacher images/s per core."""
import sys

from bench.sizing.run import DEFAULT_OUT, OPTIONS, params, run, show  # first: it fixes the threads
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="sizing", description=sys.modules["bench.sizing"].__doc__.split("\n\n")[0],
                      options=OPTIONS, params=params, run=run, show=show, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
