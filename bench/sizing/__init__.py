"""Sizing for ImageNet-1k: bytes per view per codec, teacher images/s per core, producer cores per student.

Teacher throughput per CPU core is measured here and extrapolated to the producer cores that
keep a student fed. Each teacher's rate is also given as GFLOP/s per core (2 x the multiply-adds
bench.flops counts from its symbol graph) beside this core's float32 peak, measured in the same
run; a figure one core cannot have produced is marked INVALID and the command fails (exit 1).

    python -m bench.sizing [--quick] [--student-rate 3000] [--cores 64]
                           [--out bench/results/sizing.json]

Teachers: Gluon model-zoo networks with 1000 classes and random weights (speed does not depend
on the weights, and nothing is downloaded), forward only, one thread (OMP_NUM_THREADS=1, set
before MXNet is imported, and checked: every OpenMP runtime at one thread, and the timed loop's
CPU seconds over its wall seconds at most 1.1), batch 16 of 224x224 images, hybridized as the
producer runs them. Bytes per row come from the store's own codecs (store.format.codec), not from a formula typed here.
"""
