"""Which soft-target codec keeps the teacher's knowledge? Each codec against the teacher's logits, and in a student.

    python -m bench.codecs [--quick] [--datasets digits,mnist5k,synthetic] [--seeds 5] [--jobs 2]

For each data set (digits, mnist5k, and a synthetic 1000-class case) the teacher fills one cache
per codec (`python -m kdcache.cache_builder`, offline): full float32 (the teacher's exact logits), full
float16, topk:1, topk:5, topk:10 (only where K < C), int8, and sampled:9 and sampled:16 beside the
topk:5 and topk:10 of equal bytes per row (only where those run). Each cache is read back through
the store and compared with the exact logits: bytes per row, mean T^2 * KL(teacher || rebuilt)
at T = 1, 4 and 20 (for top-K beside the ideal top-K with an even tail made from the exact
logits, and their ratio), top-1 agreement. Then the same student (`python -m kdcache.trainer`, mlp128,
the README's digits setting: T = 20, alpha = 0.5, Adam lr 1e-2, batch 64) is trained from each
cache with seeds 0..N-1 (5; 10 on mnist5k) and the same budget, beside the student from scratch (no
teacher); on mnist5k every student sees 8 views shifted by up to 2 pixels (a cache per seed: the
views are keyed by the seed), and it also trains with the teacher inline, for the Hinton-style
table (teacher, scratch, inline, cache, teacher forwards, and the fraction of the scratch-to-teacher
gap distillation closes).

The synthetic case is synthetic:n=10000,classes=1000,shape=1x4x4: class prototypes plus Gaussian
noise (pipeline.datasets). Its teacher is that generator's own posterior, a fixed linear map
(bench.codecs.metrics.posterior_teacher), not a network trained here: it knows more than the
student's 10 samples per class can show (as a teacher trained on far more data would), its
soft targets are the true class probabilities, and its accuracy (~64%) is the best any model can
reach on this data. A random linear teacher would know nothing of the labels.

Every MXNet process is a child with one compute thread (OMP_NUM_THREADS=1, --threads 1); --jobs
of them run at once. Accuracies do not depend on other load; run times do. Full run ~15-25 min on
2 cores, --quick (1 seed, 1-2 epochs, the synthetic case on 2,000 samples) ~1-2 min.
"""
