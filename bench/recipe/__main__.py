"""python -m bench.recipe: the student recipe's defaults measured on what make train runs."""
import sys

from bench.cli import bench_main
from bench.recipe.run import DEFAULT_OUT, OPTIONS, params, run, show


def main(argv=None):
    return bench_main(argv, name="recipe", description=sys.modules["bench.recipe"].__doc__.split("\n\n")[0],
                      options=OPTIONS, params=params, run=run, show=show, default_out=DEFAULT_OUT)


if __name__ == "__main__":
    sys.exit(main())
