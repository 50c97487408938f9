"""What the checksums of a finished cache cost: compaction, open, warm and cold gathers, verify, with and without.

    python -m bench.checksums [--quick] [--out bench/results/checksums.json] [--tmp DIR]

Two caches of the same rows (full float16, 1000 classes; 100,000 rows, --quick 20,000), one with
checksums (what compaction writes now) and one without (what it wrote before), side by side:

1. compaction: seconds with and without, and zlib.crc32's speed over the rows in memory
2. open: the mapped reader as it is (each chunk checked the first time a batch touches it) vs checking
   every chunk at open
3. gathers of 256 random rows, page cache warm: the first epoch (every chunk checked on the way) and the
   next one (nothing left to check), against the cache without checksums and numpy on a float16 array
                                                floor: checked >= 0.5 x numpy (both float32), as bench.read_scale
4. the first epoch after the file's pages were dropped (fsync + POSIX_FADV_DONTNEED, no root needed)
5. `kdcache verify`: seconds with and without
The warm gathers run in rounds, interleaved (the side going first rotates): an epoch of numpy, a fresh reader of
each cache for its first and next epoch; 9 rounds (--quick 3; a round is about 1.3 s at 100,000 rows). The floor
is decided on the round-by-round ratios (bench.paired): their median, reported with its spread and each round's
ratio; a floor nearer 1 than the spread is UNMEASURABLE, neither PASS nor MISS.
Per-file costs are extrapolated linearly to ImageNet-1k's 1,281,167 rows (a 2.56 GB file), the rates
are per row. A --tmp folder given is kept (the caches in it), else everything written is removed at the end.
"""
