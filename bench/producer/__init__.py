"""Producer benchmarks: the cache builder's rows/s beside the bare teacher forward, and two shards vs one.

    python -m bench.producer [--quick] [--out bench/results/producer.json] [--tmp DIR]

A full run takes about 6 min on 2 idle cores, --quick about 1 min.

Every floor is decided on paired runs (bench.paired): the two sides run back to back, interleaved (the
side going first alternates), and each floor takes the median of the run-by-run ratios, reported with its
spread and each run's ratio; a floor nearer 1 than the spread is UNMEASURABLE, neither PASS nor MISS.
Rounds: 5 for section 1 (about 10 s a round), 3 for section 2 (about 80 s a round at 160,000 rows; its
floors lie far from 1); --quick 3 and 2.

This process never imports MXNet. Every MXNet process is a child started with
OMP_NUM_THREADS=1 (the only knob that limits MXNet's compute threads, and it must be set
before `import mxnet`), so no side gets more cores than the other. The teacher is a small
Gluon CNN built and exported here (explicit prefix, fixed seed); the data set is `synthetic`.

1. Producer overhead: `python -m kdcache.cache_builder --threads 1` filling a fresh cache offline vs a
   bare loop of the same teacher over the same batches in key order (make_views + forward, no
   store), both in a fresh child process. Both sides time only their work loop (the CLI's
   reported rows_per_s; the bare loop times itself the same way, after the same warm-up), so
   process start-up, the MXNet import and the data set load are left out. Paired, interleaved
   runs.                                                                 floor: ratio >= 0.9
2. Two shards on two cores, on a data set in an .npz file: `--shards 2` (one command that forks
   two shard processes after loading; the verdict) and two producers (`--shard 0/2`,
   `--shard 1/2`, one thread each) started at once on a fresh cache vs one producer: wall time
   from start to the end of both
   processes (start-up and compaction included on both sides), and the aggregate of the rows/s
   each process reports, round by round. The 2-shard cache must be complete and hold the single
   producer's logits (within one float16 step; bitwise identity is reported too).  floor: ratio >= 1.6
3. Size of the finished cache and the teacher's forward time per batch (informative).
4. The teacher against this core's peak: GFLOP/s per core of the bare forward and of the producer's loop
   (2 x the multiply-adds bench.flops counts on the exported symbol) beside the float32 peak a child
   measures (before section 1 and after section 2; the higher counts). A figure above 1.1x the peak, or
   from a process that used more than 1.1 cores, is INVALID and the command fails (exit 1).

Each run also records how many cores other processes kept busy meanwhile (/proc/stat minus this
benchmark's own CPU time), so a report taken on a shared machine says how shared it was.

bench.producer.run is the command (sizes, section 3, the report); sections 1 and 2 are in
bench.producer.sections, the MXNet processes (teacher export, bare loop) in bench.producer.children.
"""
