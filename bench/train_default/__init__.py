"""What `make train` reaches with the default recipe on every built-in data set, against floors.

    python -m bench.train_default [--quick] [--seeds N] [--jobs N] [--out bench/results/train_default.json]

Every run is `kdcache train` as `make train DATASET=NAME SEED=S` runs it: no recipe, student, T, alpha or epochs
option, the data set's default teacher (Fashion-MNIST, which has none: one trained here), the producer started by
the trainer; one compute thread. The table gives each seed's test top-1 and the floor every seed must reach (no
lower than before the recipe change: digits 0.978, mnist5k 0.95); a floor missed is exit status 1. --quick: digits
and mnist5k, seed 0 (the test runs it).
"""
