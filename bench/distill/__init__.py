"""Does KD help? The digits teacher, a student from scratch, the same student distilled inline and from the cache.

    python -m bench.distill [--seeds 5] [--quick] [--out bench/results/distill.json]

The evidence table the README quotes, in the manner of Hinton et al. 2015 (MNIST: teacher 67
errors, student from scratch 146, distilled student 74). It trains the teacher
(`python -m kdcache.trainer.make_teacher`, or reuses `--teacher PREFIX`), then for each seed 0..N-1
trains the student three times with the same budget (epochs, learning rate, batch size, seed:
the same initialisation and the same schedule):

  scratch   --teacher-mode none: hard labels only
  inline    --teacher-mode inline: the teacher runs inside the loop (GluonCV's way)
  cache     --teacher-mode cache: soft targets from the cache; the first run's producer fills
            it, every later run (every other seed: with one view the fingerprint does not
            depend on the seed) reads it and runs the teacher zero times

and prints a markdown table: test accuracy mean +- std over the seeds, test errors, min-max.
With a float32 cache, cache and inline give the student the same logits in the same order, so
they must train the same student: the report says per seed whether they did (test accuracy and
the largest difference of any final weight).

Every MXNet process is a child with one compute thread (OMP_NUM_THREADS=1, --threads 1,
--producer-threads 1): accuracies, not speeds, are measured here, and they do not depend on
other load on the machine. Full run ~4 min on one core, --quick (2 seeds, 4 epochs) ~30 s.
"""
