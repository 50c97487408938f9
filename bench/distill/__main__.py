"""python -m bench.distill: the teacher, a student from scratch, distilled inline and from the cache, on digits."""
import sys

from bench.distill.run import DEFAULT_OUT, OPTIONS, params, run, show  # first: it fixes the threads
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="distill", description=sys.modules["bench.distill"].__doc__.split("\n\n")[0], options=OPTIONS, params=params,
                      run=run, show=show, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
