"""Publishing and pulling a cache: the pull's rate against curl, a resume after a kill, ImageNet-1k's size.

    python -m bench.publish [--quick] [--out bench/results/publish.json] [--tmp DIR]

A real nginx (apt-get install nginx-light) on a loopback port serves a published cache:

1. the pull's rate: the same file fetched by curl, by kdcache pull's transfer (sha256 as it arrives, fsync) and by
   the whole kdcache pull command, in interleaved rounds; floor: transfer >= 0.9 x curl (paired rounds)
2. a pull killed with SIGKILL once half the file is staged, then run again: bytes nginx sent twice, floor <= one read
3. a cache of ImageNet-1k's size (1,281,167 rows x 1000 classes, full float16, 2.56 GB; simulated targets written
   by the store's writer) published into the served folder and pulled into a fresh cache directory
--quick: a 20 MB file and a 50,000-row cache, three rounds: seconds.
"""
