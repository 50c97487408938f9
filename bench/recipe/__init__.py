"""The student recipe's defaults measured: optimiser x schedule x rate, on real digits.

    python -m bench.recipe [--quick] [--epochs E] [--out bench/results/recipe_sweep.json]

Every run is `python -m kdcache.trainer --teacher-mode none` (hard labels: the recipe, not the
teacher, is measured) on one thread; the table gives the final test top-1 (mean and spread over
seeds) and the validation top-1 of the best epoch. --quick: digits, one student, two recipes,
two epochs (the test runs it).
"""
