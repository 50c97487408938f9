"""Distillation on 60,000 real images: does the cache close the teacher-student gap on Fashion-MNIST as the teacher inline does?

    python -m bench.quality [--seeds 5] [--jobs 2] [--teacher PREFIX] [--quick] [--out bench/results/quality.json]
    make bench-quality [QUICK=1]

The full Fashion-MNIST (60,000 training and 10,000 test images of clothing, 28x28, 10 classes), read from the
Debian package's IDX files (`apt-get install dataset-fashion-mnist`, as root; --data-root elsewhere). A CNN
teacher is trained here (`python -m kdcache.trainer.make_teacher --arch mnist_teacher`, shifts and flips), or
--teacher reuses one. Two students, each with its own budget, the same for its three rows (epochs, learning
rate, batch, seed: the same initialisation and the same order of batches):

  mlp800x2        Hinton et al. 2015's MNIST student, 784-800-800-10 (ReLU)
  small_cnn_flat  a small CNN (~20k weights): small_cnn averages its maps away and is 6x slower here

each trained with seeds 0..N-1 three ways:

  scratch   --teacher-mode none: the hard labels alone
  inline    --teacher-mode inline: the teacher runs inside the loop (epochs x 60,000 forwards a seed)
  cache     --teacher-mode cache: soft targets from the cache, filled once (60,000 forwards) before any
            student reads it; with one view its fingerprint depends neither on the seed nor on the student,
            so every cache student of both networks runs the teacher zero times

The report gives test accuracy mean ± std and min-max over the seeds, the teacher forwards each way,
gap_closed = (cache mean - scratch mean) / (teacher - scratch mean) per student, and whether cache and
inline agree within the seeds' spread; verdicts PASS/MISS for the two floors (one student closes >= 60% of
the gap; cache equals inline within the spread for every student).

Every MXNet process is a child with one compute thread; --jobs of them run at once (the teacher beside
the students from scratch, which need none). Full run ~13-25 min with --jobs 2 on 2 shared cores; --quick (the
first 2,000 training and 1,000 test images of the real files as an .npz, a 2-epoch teacher, 2 seeds of
1-epoch students) ~1-2 min.
"""
