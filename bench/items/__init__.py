"""What checking a user's own data set item by item costs, at 224 px: the digest, and the first epoch against the next.

    python -m bench.items [--quick] [--out bench/results/items.json] [--tmp DIR]

A plain data set of N items (3x224x224, as uint8 and as float32; 512 items, --quick 128) in RAM, and a
cache of its items (full float16, 1000 classes) that records each item (store.format.items):

1. the digest of one item (pipeline.digests.item_digest: SHA-256 of its float32 values), uint8 items
   converted to float32 first, as SoftTargetDataset does anyway
2. SoftTargetDataset: seconds per item in the first epoch (each item compared with its record) and in
   the next one (nothing left to check): the next epoch is the plain read; the difference is the
   check's cost, paid once per item
3. SoftTargetDataset's construction (its first items are checked there)
"""
