"""Reading a finished cache at ImageNet-1k size: the memory-mapped reader beside today's RAM path and numpy.

    python -m bench.read_scale [--quick] [--out bench/results/read_scale.json] [--tmp DIR]

A full run takes about 8 min on 2 cores and writes up to 20 GB or so (it keeps 20 GB of the disk free),
--quick under a minute.

One run, every comparison side by side (the sizes: 1,281,167 rows x 1000 classes, full float16,
2.56 GB; --quick: 100,000 rows):

1. write the cache through CacheWriter (shuffled order, batches of 256) and compact it: rows/s, seconds
2. open the same file mapped (CacheReader's default) vs today's RAM path (mmap=False, float32)
3. random gathers of 256 rows, page cache warm: reader.get on the map vs numpy fancy indexing of
   the same float16 array in RAM, with and without the float32 conversion; and today's reader
                                                                   floor: map >= 0.5 x numpy (both float32)
4. memory of 4 reader processes gathering one random epoch each from the one file: the sum of their
   proportional set sizes (Pss) while all are alive, vs the file size; the same with mmap=False
   (as many as the memory holds)                                   floor: map <= 1.25 x the file
5. the first epoch after the file's pages were dropped from the page cache (no root needed:
   fsync + POSIX_FADV_DONTNEED, checked with mincore): random and key order through the map
6. a cache of several views, sized to the free disk (20 GB kept free): open, gathers (map vs
   mmap=False, which falls back to reads from disk when the cache does not fit the memory budget),
   and the Pss of 4 mapped readers

The gathers' floor is decided on paired rounds (bench.paired): every side runs once a round, interleaved
(the side going first rotates), 5 rounds (3 in --quick; a full round takes about 12 s); the floor takes the
median of the round-by-round ratios, reported with its spread and each round's ratio, and one nearer 1 than
the spread is UNMEASURABLE. The Pss floor is not paired: it is a size, the pages the readers hold while all
are alive, which other processes' load does not move from run to run as it moves a timing; one measurement
decides it, as the store's bytes per row are.

bench.read_scale.run is the command, bench.read_scale.sections the measurements; reader processes
(bench.read_scale.children) import numpy, h5py and store only. Without --tmp everything written is removed
at the end; with it, the run's folder is kept there (each cache removed once measured).
"""
