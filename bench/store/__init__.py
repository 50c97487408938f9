"""Store micro-benchmarks: gathers, write order and bytes per row, each beside its baseline.

    python -m bench.store [--quick] [--out bench/results/store.json] [--tmp DIR]

A full run takes about 1 min on 2 cores, --quick about 15 s.

Every comparison runs both sides in the same process, interleaved (the side that goes first
rotates each repeat), and keeps the best of the repeats, so machine noise hits both sides.
Sections, with the floors the store was built to meet:

1. gather from a cache held in RAM vs numpy fancy indexing on the same array  (ratio >= 0.5)
2. gather vs one .npy file per sample, torchdistill's old layout              (ratio >= 20)
3. writes in shuffled training order vs in index order, C=10 and C=1000       (ratio >= 0.5)
4. bytes per row of each codec, from the codec and measured on disk         (topk:K <= 4K+8)
5. gather from disk (memory_budget=0), informative only
6. how soon a row a producer process commits is visible to a reader, informative only

bench.store.run is the command (sizes, report); the sections are in bench.store.gather (1, 2, 5)
and bench.store.write (3, 4, 6), each floor beside the section it judges.
"""
