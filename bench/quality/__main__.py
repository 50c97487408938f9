"""python -m bench.quality: distillation on the full Fashion-MNIST, from scratch, inline and from the cache."""
import sys

from bench.quality.run import DEFAULT_OUT, OPTIONS, params, run, show  # first: it fixes the threads
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="quality", description=sys.modules["bench.quality"].__doc__.split("\n\n")[0],
                      options=OPTIONS, run=run, show=show, params=params, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
