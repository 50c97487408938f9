"""The student recipe's defaults measured on what `make train` runs: optimiser x rate, distilling from the cache.

    python -m bench.recipe [--quick] [--jobs N] [--epochs E] [--out bench/results/recipe_sweep.json]

Every run is `kdcache train` as `make train DATASET=NAME SEED=S` runs it (KD from the cache at the trainer's default
T and alpha, the default student and epochs) with the recipe's --optimizer, --lr-mode and --lr, on one thread, on
every built-in data set (digits, mnist5k; Fashion-MNIST where installed: its finalists only). The choice is the
recipe with the best last-epoch top-1 on the validation slice (never the test split), averaged over seeds and data
sets. --quick: digits, two recipes, two epochs (the test runs it).
"""
