"""python -m bench.quality: distillation on the full Fashion-MNIST, from scratch, inline and from the cache."""
import os
import sys

from bench.common import limit_threads

limit_threads(os.environ)  # before anything loads MXNet or BLAS (bench.quality's import did it too)

from bench.cli import bench_main  # noqa: E402
from bench.quality import DEFAULT_OUT, OPTIONS, params, run, show  # noqa: E402


def main(argv=None):
    return bench_main(argv, name="quality", description=sys.modules["bench.quality"].__doc__.split("\n\n")[0],
                      options=OPTIONS, run=run, show=show, params=params, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
