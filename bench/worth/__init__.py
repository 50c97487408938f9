"""What the cache buys at equal compute: on the full Fashion-MNIST, which student does a fixed budget give?

    python -m bench.worth [--seeds 3] [--jobs 2] [--teacher PREFIX] [--budget-scale K] [--resume DIR] [--quick]
    make bench-worth [QUICK=1]

bench.quality asks whether the cache is as good as the teacher in the loop; this asks what a user decides by:
for the compute I have, which student do I get? Each student (Hinton's 2x800 MLP, a small CNN) gets the same
wall-clock budget of one core (start-up and the final test pass included), trained three ways:

  scratch          the hard labels alone
  inline           the teacher runs inside the loop: every step pays its forwards
  cache            soft targets from a cache filled once; the fill's time charged to this student, and again
                   amortised over every student that reads the same cache

The epochs each way gets are what its budget buys, from a two-epoch calibration of each way run first. Then
the patient and consistent teacher, at its own budget (15 min: >= 50 epochs after its fill), for the small
CNN: one cache of V keyed views with mixup (V = 8), against the same augmentation inline and from scratch.
Then a sweep: N students (networks, T, alpha) from one cache against the same N inline: teacher forwards and
wall time. Floors: the cache's student beats inline by >= 0.5 point and scratch by >= 1 point at every
budget; the patient student trains >= 50 epochs and closes >= 60% of the teacher-scratch gap.

Every MXNet process is a child with one compute thread; --jobs of them run at once. Full run ~3 h with
--jobs 2 on 2 cores; --quick (2,000 training and 1,000 test images, budgets of 10 and 16 s, the patient's
20 s) a few minutes.
With --resume DIR the work is kept in DIR with a journal of the finished runs: the same command resumes.
"""
