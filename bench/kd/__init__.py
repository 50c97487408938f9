"""KD end to end: the student alone, inline KD, inline on MXNet's async engine, and kdcache (online, warm, ring).

    python -m bench.kd [--quick] [--rounds N] [--out bench/results/kd.json] [--tmp DIR]

A full run (4 rounds) takes about 17 min on 2 idle cores, --quick (one round of every scenario, four of warm and
the student alone) under 3 min.

This process never imports MXNet; every MXNet process is a child with OMP_NUM_THREADS=1 (the
only knob that limits MXNet's compute threads, fixed before `import mxnet`). On this CPU-only
machine two devices are emulated by two cores: where the teacher and the student run apart
(kdcache's producer and trainer) each gets one core (`--threads 1 --producer-threads 1`);
where they run together (inline) they share the student's one core, as on one GPU.

Data: `synthetic` 3x32x32, 10 classes, sized from the measured student step so that one student
epoch takes about 5 s (--quick: 0.75 s, 3 steps at least); 2 epochs (--quick: 1). Student: `small_cnn`. Two
teachers, exported here (explicit prefix, fixed seed): a VGG-style CNN whose width (a multiple
of 8) and depth are calibrated so that its forward of a batch takes about 1/3 (light) or 2x
(heavy) the student's training step on the same batch, both on one thread; the measured ratios
are printed.

Scenarios, for each pair, each with a fresh cache directory where one is used:
  student_only   python -m kdcache.trainer --teacher-mode none: the limit any KD method can reach
  inline         --teacher-mode inline: teacher forward then student step, batch by batch
  inline_async   a loop of this benchmark (same data, schedule, student, KDLoss) that issues the teacher's
                 forward of the next batch before the student's step and never waits for it:
                 MXNet's asynchronous engine may overlap them. One engine worker (the default):
                 the student's one core, like `inline`.
  inline_async_2w  the same with MXNET_CPU_WORKER_NTHREADS=2: the engine may run the teacher
                 and the student at once on two cores (the core budget of online/ring); informative,
                 one epoch, not in --quick
  online         --teacher-mode cache on a cold cache: the trainer starts the producer
  warm           a second experiment on the cache `online` completed: no teacher at all
  ring           --store ring: streamed through shared memory, nothing persisted
Floors use two more measurements of each pair: "teacher alone" (the producer's offline loop,
cache_builder.produce.produce_offline, as `python -m kdcache.cache_builder --threads 1` runs it in a process
of its own, filling the train split into a fresh cache: rows/s of the loop -> seconds per epoch) and
"student alone" (student_only's epoch 1). Runs here vary by several per cent from one to the next, so
everything runs in rounds (--rounds, default 4; --quick 5, every scenario in the first only): each round runs the teacher alone and every
scenario of each pair once, in ORDER (reversed after `online` every second round); every floor is decided
on the median of the rounds' paired ratios (warm / student_only of the same round, ...) and its spread
(bench.paired NOTE: a floor closer to 1.0 than the spread is UNMEASURABLE, not PASS or MISS).

Each trainer and producer is watched by a /proc poller (every 0.2 s: VmHWM of the trainer and
of its children), and the CPU time the other processes of the machine used meanwhile is recorded
(/proc/stat), so a report taken on a shared machine says how shared it was.

bench.kd.run is the command (sizes, floors, report); bench.kd.scenarios runs the scenarios,
bench.kd.children is the MXNet processes (calibration, the test-split caches, the inline_async loop).
"""
