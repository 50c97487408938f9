"""python -m bench.ensemble: what a read-time ensemble of teachers adds, students from each teacher and from them all."""
import sys

from bench.ensemble.run import OPTIONS, params, run, show  # first: it fixes the threads
from bench.cli import bench_main


def main(argv=None):
    # no default --out here: it depends on --dataset, and params fills it in
    return bench_main(argv, name="ensemble", description=sys.modules["bench.ensemble"].__doc__.split("\n\n")[0],
                      options=OPTIONS, params=params, run=run, show=show)


if __name__ == "__main__":
    sys.exit(main())
