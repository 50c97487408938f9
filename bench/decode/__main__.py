"""python -m bench.decode: photos from JPEG files at 224 px, the producer with decode workers vs the teacher alone."""
import sys

from bench.cli import bench_main
from bench.decode.run import DEFAULT_OUT, OPTIONS, params, run, show


def main(argv=None):
    return bench_main(argv, name="decode", description=sys.modules["bench.decode"].__doc__.split("\n\n")[0],
                      options=OPTIONS, params=params, run=run, show=show, default_out=DEFAULT_OUT, threads=None)


if __name__ == "__main__":
    sys.exit(main())
