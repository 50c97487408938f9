"""python -m bench.train_default: the default recipe's test accuracy on every built-in data set, against floors."""
import sys

from bench.cli import bench_main
from bench.train_default.run import DEFAULT_OUT, OPTIONS, params, run, show


def main(argv=None):
    return bench_main(argv, name="train_default",
                      description=sys.modules["bench.train_default"].__doc__.split("\n\n")[0], options=OPTIONS,
                      params=params, run=run, show=show, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
