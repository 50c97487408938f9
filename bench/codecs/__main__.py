"""python -m bench.codecs: which soft-target codec keeps the teacher's knowledge, against its logits and in a student."""
import sys

from bench.codecs.run import DEFAULT_OUT, OPTIONS, params, run, show  # first: it fixes the threads
from bench.cli import bench_main


def main(argv=None):
    return bench_main(argv, name="codecs", description=sys.modules["bench.codecs"].__doc__.split("\n\n")[0],
                      options=OPTIONS, params=params, run=run, show=show, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
