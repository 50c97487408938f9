"""Store micro-benchmarks: gathers, write order and bytes per row, each beside its baseline.

    python -m bench.store [--quick] [--out bench/results/store.json] [--tmp DIR]

A full run takes about 70 s on 2 cores, --quick about 15 s.

Every comparison runs both sides in the same process, interleaved over several rounds (the side
that goes first rotates each round), so that round r of each side met the same load. Each timing
floor is decided on the round-by-round ratios (bench.paired): their median, its spread and each
round's ratio are reported, and a floor nearer 1 than the spread is UNMEASURABLE, neither PASS nor
MISS. Rounds: 9 for the gathers and the writes (a round takes well under 2 s; from nine pairs the
median's interval leaves out the highest and the lowest ratio), 5 against the per-sample files
(3.4 s a round), 3 each in --quick. The bytes per row are exact sizes, judged as they are.
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
