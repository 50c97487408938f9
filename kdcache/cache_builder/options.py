"""The producer's command line: its description, its own options beside the shared ones, and the checks
that span them (a mistake exits with one line and status 2 before anything runs). No MXNet here."""
import argparse
import os

from kdcache.args import Address, Dir, Int, Name, Option, OutFile, Parser, add_options
from kdcache.cache_builder.errors import ProducerError
from kdcache.pipeline.options import SHARED, Shard, check_applies, check_views, resolve_teacher

DESCRIPTION = """\
Run a frozen MXNet teacher forward on the CPU over a data set and store its raw logits
(temperature 1) in a cache named by the fingerprint of the teacher, the data, the views and the
codec. A complete cache with the same fingerprint is reused: the teacher then runs zero times.
Offline (default) fills every (sample, view); --online follows the training schedule (the same
--seed/--epochs/--batch-size/--views as the trainer) so targets arrive in the order training
reads them. Interrupted runs (Ctrl-C, kill -9) resume where they stopped."""


RING_TIMEOUT = 600.0  # seconds an attaching producer waits for the trainer's ring ($KDCACHE_RING_TIMEOUT)


def ring_timeout():
    """$KDCACHE_RING_TIMEOUT as seconds (> 0), else RING_TIMEOUT; ValueError naming it when it is no number."""
    value = os.environ.get("KDCACHE_RING_TIMEOUT", "")
    try:
        seconds = float(value) if value.strip() else RING_TIMEOUT
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ProducerError(f"KDCACHE_RING_TIMEOUT={value!r}: use a number of seconds > 0, or unset it")
    return seconds


PRODUCER = [
    Option("--split", "which split of the data set to run the teacher on", choices=("train", "test"),
           default="train", group="producing"),
    Option("--online", "follow the training schedule (--seed, --epochs, --batch-size, --views: the trainer's) "
           "instead of key order", action="store_true", group="producing"),
    Option("--threads", "teacher compute threads (default: $KDCACHE_TEACHER_THREADS when set, else all cores but "
           "one, left to the trainer; cores/N with --shards N)", type=Int(1, 1024), metavar="N", group="producing", make="THREADS"),
    Option("--decode-workers", "processes that decode and augment the next batches while the teacher runs this one "
           "(0: in this process; default: the cores the teacher's threads leave for image files (recordio, "
           "imagefolder), 0 for data held in RAM)", type=Int(0, 256), metavar="N", group="producing"),
    Option("--shard", "fill only the keys with key mod n = i (n producers share the work)", type=Shard(),
           default="0/1", metavar="i/n", group="producing"),
    Option("--shards", "fork N shard producers after loading the data set once (each --threads, default "
           "cores/N); the same as N commands with --shard 0/N .. N-1/N, minus N-1 start-ups", type=Int(1, 256),
           default=1, metavar="N", group="producing", make="SHARDS"),
    Option("--engine", "local: this process (with --scratch, it writes immutable parts); ray: Ray actors on the "
           "cluster at --address (a local one on 127.0.0.1 without it) fill the cache as immutable parts, one per "
           "task of --block-rows keys, each published exactly once (needs pip install 'kdcache[ray]')",
           choices=("local", "ray"), default="local", group="many hosts"),
    Option("--address", "with --engine ray: the cluster to run on, auto (the one `ray start` made here) or "
           "HOST:PORT (default: start a local cluster on 127.0.0.1 for this command, stopped after)",
           type=Address(), metavar="ADDRESS", group="many hosts"),
    Option("--actors", "with --engine ray: teacher actors (default: the cluster's CPUs / --actor-cpus)",
           type=Int(1, 4096), metavar="N", group="many hosts"),
    Option("--actor-cpus", "with --engine ray: CPUs (and teacher threads) of each actor", type=Int(1, 256),
           default=1, metavar="N", group="many hosts"),
    Option("--block-rows", "keys per task (one immutable part each); a multiple of --batch-size gives parts bit "
           "for bit equal to a one-host build's rows", type=Int(1, 1 << 30), default=4096, metavar="N",
           group="many hosts"),
    Option("--scratch", "write each part in DIR first (local disk), then publish it into the cache folder; with "
           "the local engine this switches the producer to parts (--shard i/n: tasks j with j mod n = i), so "
           "hosts sharing a network file system never write a file another reads (default for --engine ray: "
           "a folder in the temp directory)", type=Dir(), metavar="DIR", group="many hosts"),
    Option("--ring", "stream to the shared-memory ring NAME instead of a cache file (pure streaming: keys are "
           "(sample, epoch), nothing is persisted; implies --online); it waits $KDCACHE_RING_TIMEOUT seconds (default "
           f"{RING_TIMEOUT:g}) for the trainer to create the ring", type=Name(), metavar="NAME",
           group="producing"),
    Option("--ring-capacity", "create the ring with this many rows (default: attach to the ring the trainer "
           "made)", type=Int(1, 1 << 28), metavar="ROWS", group="producing"),
    Option("--hold", "with --online, as `kdcache train` starts its producer before it knows the cache's name: "
           "load the data set and the teacher, then wait for one JSON line on stdin, {\"cache\": PATH, "
           "\"fingerprint\": FP}, and fill the cache at PATH (FP must be the fingerprint these options give); "
           "end of input ends it with nothing written", action="store_true", group="producing"),
    Option("--timeline", "with --online/--ring: write (time, schedule position, rows) per step to FILE as JSON "
           "when done", type=OutFile(), metavar="FILE", group="output"),
    Option("--json", "end with one JSON line: cache_path, fingerprint, rows_written, teacher_forwards, ...",
           action="store_true", group="output"),
    Option("--result", "write that JSON result to FILE too (atomically), for a program that started this one",
           type=OutFile(), metavar="FILE", group="output"),
    Option("--quiet", "no progress bar", action="store_true", group="output"),
]


def build_parser(prog="python -m kdcache.cache_builder"):
    p = Parser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_options(p, SHARED + PRODUCER, cache={"help": "explicit cache path instead of <cache-dir>/<fingerprint>"})
    return p


def parse_args(argv=None, prog="python -m kdcache.cache_builder"):
    """The options, checked: a mistake exits here with one line and status 2, before anything runs."""
    p = build_parser(prog)
    args = p.parse_args(argv)
    if args.cache == "auto":
        args.cache = None
    resolve_teacher(args, p)
    check_views(args, p)
    check_applies(args, p)
    if args.ring and (args.shards > 1 or args.shard.count > 1):
        p.error("argument --ring: a ring streams from one producer; drop --shard/--shards")
    if args.shards > 1 and args.shard.count > 1:
        p.error(f"argument --shards: --shards {args.shards} forks shards 0/{args.shards} .. "
                f"{args.shards - 1}/{args.shards} itself; drop --shard")
    if args.timeline and not (args.online or args.ring):
        p.error("argument --timeline: an offline build follows no schedule; add --online (or drop --timeline)")
    if args.ring:
        try:
            ring_timeout()
        except ValueError as e:
            p.error(str(e))
    if args.ring_capacity is not None and not args.ring:
        p.error("argument --ring-capacity: it sizes a ring; add --ring NAME (or drop --ring-capacity)")
    if args.hold and (not args.online or args.ring or args.shards > 1 or args.cache):
        p.error("argument --hold: it holds an --online producer until its cache is named on stdin; add --online, "
                "drop --ring, --shards and --cache")
    parts = args.engine == "ray" or args.scratch
    if parts and (args.online or args.ring or args.hold or args.shards > 1):
        p.error(f"argument {'--engine ray' if args.engine == 'ray' else '--scratch'}: parts are filled offline, in "
                f"key order; drop --online, --ring, --hold and --shards (use --actors, or --shard i/n per host)")
    if args.engine == "ray" and args.shard.count > 1:
        p.error("argument --shard: with --engine ray the driver gives every task to the cluster's actors; drop --shard")
    for name in ("address", "actors"):
        if getattr(args, name) is not None and args.engine != "ray":
            p.error(f"argument --{name}: it applies to --engine ray; add it (or drop --{name})")
    if args.split == "test" and (args.online or args.ring):
        p.error("argument --split: the test split is filled offline; drop --online/--ring")
    return args
