"""The trainer's command line (no MXNet import here: threads are fixed before MXNet loads)."""
import argparse

DESCRIPTION = """\
Train a student network with knowledge distillation from cached teacher logits.

Teacher modes: cache (default) reads the teacher's raw logits from the soft-target cache
named by the teacher, data, views and codec; when the cache is incomplete and no producer is
running, a producer (python -m cache_builder --online) is started on the cores the trainer
leaves free, and targets not there yet are waited for (counted as stall). inline runs the
teacher inside the training loop (GluonCV's way; same loss code). none trains on the hard
labels alone. A warm cache makes the teacher cost nothing: a second experiment with another
student, temperature or alpha reuses it."""

DEFAULT_TEACHER = "teachers/digits"


def build_parser():
    p = argparse.ArgumentParser(prog="python -m trainer", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("data")
    g.add_argument("--dataset", default="digits", help="data set (see python -m cache_builder --help); default digits")
    g.add_argument("--data-root", metavar="PATH", help="local files of the data set")
    g.add_argument("--image-size", metavar="HxW", help="resize decoded images (recordio, imagefolder)")
    g.add_argument("--num-classes", type=int, help="class count when the files do not say")
    g.add_argument("--views", type=int, default=1, help="augmented views per sample; epoch e uses view e mod V")
    g.add_argument("--augment", default="auto", help="none | crop:PAD | flip | crop:PAD,flip (auto: none for 1 view)")
    g = p.add_argument_group("student")
    g.add_argument("--student", default="mlp128",
                   help="mlp128 (default) | mlp | small_cnn | a Gluon model-zoo name (resnet18_v1, ...)")
    g.add_argument("--epochs", type=int, default=30, help="default 30")
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 1e-2; the defaults were "
                   "measured on digits: see the README's table)")
    g.add_argument("--wd", type=float, default=1e-4, help="weight decay (default 1e-4)")
    g.add_argument("--seed", type=int, default=0, help="seed of the schedule, augmentation and initialisation")
    g.add_argument("--ctx", default="auto",
                   help="auto (GPU when MXNet sees one) | cpu | gpu:0[,1,...] (several GPUs: each batch is split "
                   "across them, gradients summed by the device kvstore) | cpu:0,1 (the same on CPU contexts)")
    g.add_argument("--threads", type=int, help="trainer compute threads (default: the cores the producer leaves)")
    g.add_argument("--kvstore", help="MXNet kvstore: device (several devices; the default then), dist_sync or "
                   "dist_async (workers started by python -m trainer.launch); default: none for one device")
    g = p.add_argument_group("distillation")
    g.add_argument("--teacher-mode", default="cache", choices=["cache", "inline", "none"])
    g.add_argument("--teacher", metavar="PREFIX[:EPOCH]", default=None,
                   help=f"teacher checkpoint (default {DEFAULT_TEACHER} for digits, built by make teacher)")
    g.add_argument("--teacher-input", metavar="NAME", help="the teacher's image input name")
    g.add_argument("--teacher-mean", metavar="M[,M,M]")
    g.add_argument("--teacher-std", metavar="S[,S,S]")
    g.add_argument("--teacher-size", metavar="HxW")
    g.add_argument("--temperature", "-T", type=float, default=20.0, help="KD temperature (default 20, as GluonCV)")
    g.add_argument("--alpha", type=float, default=0.5, help="weight of the soft term (default 0.5 = GluonCV's hard weight 0.5)")
    g = p.add_argument_group("cache")
    g.add_argument("--cache", default="auto", metavar="PATH|auto",
                   help="cache path, or auto: <cache-dir>/<fingerprint of these inputs>")
    g.add_argument("--cache-dir", help="cache directory (default: $KDCACHE_DIR, else ./caches)")
    g.add_argument("--codec", default="full", help="full | topk:K (default full)")
    g.add_argument("--dtype", default="float16", choices=["float16", "float32"])
    g.add_argument("--store", default="cache", choices=["cache", "ring"],
                   help="cache: persistent HDF5 (default); ring: stream through shared memory, nothing persisted")
    g.add_argument("--ring-capacity", type=int, default=4096, help="ring size in rows (default 4096)")
    g.add_argument("--no-producer", action="store_true", help="never start a producer; wait for one started elsewhere")
    g.add_argument("--producer-threads", type=int, help="threads of the producer the trainer starts (default 1)")
    g.add_argument("--wait-timeout", type=float, default=600.0, help="seconds to wait for a missing target (default 600)")
    g = p.add_argument_group("run")
    g.add_argument("--run", help="run name: outputs go to runs/<run>/ (default: a time stamp)")
    g.add_argument("--runs-dir", default="runs")
    g.add_argument("--resume", action="store_true", help="continue runs/<run>/ from its last checkpoint")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.add_argument("--json", action="store_true", help="end with the metrics as one JSON line")
    return p
