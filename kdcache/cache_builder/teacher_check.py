"""kdcache verify PATH --teacher PREFIX: run the teacher again on sampled keys and compare with the cache.

The store's own checks (schema, flags, fingerprint, finite values) say a cache is well formed;
only the teacher can say its rows are right. Each sampled key's input is rebuilt from what the
cache records (data set identity, augmentation and its seed, views, the teacher's
preprocessing), as TinyViT's --check-saved-logits does, and the stored row must equal the
teacher's output up to what the codec's storage type rounds away.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

from kdcache.args import Allowed, Int, Option, Parser, add_options, fail
from kdcache.cache_builder.errors import ProducerError
from kdcache.errors import as_command
from kdcache.pipeline.options import SHARED_BY_DEST
from kdcache.threads import fix_threads

DESCRIPTION = """\
Check a cache against its teacher: first the store's checks (as kdcache verify PATH without
--teacher), then the teacher runs again on --sample random keys (sample index, view), each
input rebuilt from what the cache records: the data set, the augmentation and its seed, the
teacher's preprocessing. Reports the largest |stored - teacher| logit difference and the top-1
agreement. The teacher's files must be the ones the cache was built from (their SHA-256).
Exit 0: sound and every key within the codec's tolerance; 1: not, or suspect (every row the same:
the teacher saw alike inputs, e.g. NaN images); 2: a mistake (another teacher, data set files
missing or different, bad options)."""

DEFAULT_SAMPLE = 256
SHOWN = 10  # keys beyond tolerance listed by name


class Sample(Allowed):
    """An integer >= 1, or all (every key)."""

    def __call__(self, s):
        v = str(s).strip().lower()
        if v == "all":
            return "all"
        try:
            n = int(v)
        except ValueError:
            fail(f"{s!r} is not a count: use an integer >= 1, or all for every key")
        if n < 1:
            fail(f"{n} is not allowed: use an integer >= 1, or all for every key")
        return n


VERIFY = [
    Option("--epoch", "the teacher's checkpoint epoch (default: the one the cache records, as PREFIX:EPOCH)",
           type=Int(0, 9999), metavar="E", group="teacher check"),
    Option("--sample", f"how many random keys to check, or all (default {DEFAULT_SAMPLE})", type=Sample(),
           default=DEFAULT_SAMPLE, metavar="N|all", group="teacher check"),
    Option("--threads", "teacher compute threads (OMP_NUM_THREADS)", type=Int(1, 1024), default=1, metavar="N",
           group="teacher check"),
    Option("--json", "print the report as JSON", action="store_true", group="output"),
    Option("--quiet", "no progress bar", action="store_true", group="output"),
]


class Refused(ProducerError):
    """The check cannot run as asked (exit 2); the message names the cause and the fix."""


def build_parser(prog="kdcache verify"):
    p = Parser(prog=prog, description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", help="cache path (P, P.h5 or P.parts)")
    shared = [SHARED_BY_DEST[d] for d in ("teacher", "seed", "batch_size", "data_root", "image_size")]
    add_options(p, shared + VERIFY, teacher={"required": True, "help": "the teacher the cache was built from: "
                                             "PREFIX-symbol.json + PREFIX-NNNN.params (without --teacher, "
                                             "kdcache verify PATH runs the store's checks only)"},
                seed={"help": "seed of the random sample of keys (the augmentation's seed is the cache's)"},
                batch_size={"help": "teacher batch"},
                data_root={"help": "the data set's local files (default: the folder the cache records; give it when "
                                   "the files have moved)"},
                image_size={"help": "resize decoded images to HxW (default: as the cache records; recordio, "
                                    "imagefolder)"})
    return p


@as_command  # a KdcacheError is one line and exit 2 (could not check); anything else shows as the bug it is
def main(argv=None, prog="kdcache verify"):
    args = build_parser(prog).parse_args(argv)
    fix_threads(args.threads)  # before MXNet loads: only this limits its threads
    try:
        report = check(args)
    except KeyboardInterrupt:
        print("interrupted: nothing was changed", file=sys.stderr)
        return 130
    ok = report["sound"] and not report["suspect"] and report["teacher_check"] is not None and \
        report["teacher_check"]["match"]
    if args.json:
        print(json.dumps(report, indent=1, default=str))
    else:
        print_report(report)
    return 0 if ok else 1


def check(args):
    """The store's verdict, then the teacher's: the report as a dict."""
    from kdcache.store.folder import registry
    base = registry.base_path(args.path)
    if not base or not registry.exists(base):
        raise Refused(f"no cache at {args.path!r}: pass a path that `kdcache ls` shows (P, P.h5 or P.parts)")
    report, problems = registry.verify(base)
    report.update(sound=not problems, problems=problems, teacher_check=None)
    if problems:
        return report
    from kdcache.store import CacheSpec
    from kdcache.store.files.segment import open_final, read_meta
    fin = registry.final_path(base)
    with open_final(fin) as f:  # sound: a finished file of a known format version
        spec = CacheSpec.from_meta(read_meta(f, fin))
        topt = recorded_teacher(args, spec.inputs.get("teacher"), report["path"])
        dataset, augment, seed = recorded_inputs(args, spec.inputs, spec.sources)
        report["teacher_check"] = compare(args, f, spec, topt, dataset, augment, seed)
    return report


def short(t):
    """A teacher identity as one word: name:epoch@params digest, symbol digest."""
    return (f"{t.get('name')}:{t.get('epoch')}@{str(t.get('params_sha256'))[:12]}"
            f"/{str(t.get('symbol_sha256'))[:12]}")


def recorded_teacher(args, rec, where):
    """The passed checkpoint with the preprocessing the cache records; its files must be the cache's."""
    from kdcache.pipeline.teacher_files import TeacherOptions, parse_teacher_arg
    if not isinstance(rec, dict) or not rec.get("params_sha256") or not rec.get("symbol_sha256"):
        raise Refused(f"cache {where} records no teacher checkpoint digests ({rec!r}): it was not built by "
                      f"kdcache cache, so no teacher can be checked against it; drop --teacher")
    prefix, epoch = parse_teacher_arg(args.teacher)
    if args.epoch is not None:
        if epoch is not None and epoch != args.epoch:
            raise Refused(f"--teacher {args.teacher} names epoch {epoch}, --epoch says {args.epoch}: give one")
        epoch = args.epoch
    if epoch is None and os.path.isfile(f"{prefix}-{int(rec.get('epoch') or 0):04d}.params"):
        epoch = int(rec.get("epoch") or 0)
    topt = TeacherOptions(prefix, epoch, rec.get("input"), rec.get("mean"), rec.get("std"), rec.get("size"))
    got = topt.identity()
    if (got["params_sha256"], got["symbol_sha256"]) != (rec["params_sha256"], rec["symbol_sha256"]):
        raise Refused(f"cache {where} was built by teacher {short(rec)}, you passed {short(got)}: "
                      f"pass the right --teacher (and --epoch)")
    return topt


def dataset_name(rec):
    """The --dataset value that loads the recorded data set (synthetic's parameters included)."""
    name = rec.get("name")
    if name != "synthetic":
        return name
    n = int(rec["n"]) * (5 if rec.get("split") == "test" else 1)  # the test split records n // 5
    shape = "x".join(str(int(s)) for s in rec["shape"])
    return f"synthetic:n={n},classes={int(rec['classes'])},shape={shape},seed={int(rec['seed'])}"


def recorded_inputs(args, inputs, sources=None):
    """(data set, augmentation, augmentation seed) as the cache records them; the data set must be
    the same one (its identity: name, split, length, content digest). Its files are read from where the
    cache records (`sources`: data_root, image_size); an explicit --data-root or --image-size that
    disagrees with the record is refused naming both (a --data-root is taken when the recorded folder is
    gone: the files moved)."""
    from kdcache.pipeline.cachespec import augment_from_inputs
    from kdcache.pipeline.datasets import BUILTIN, DATASETS, load_dataset
    from kdcache.pipeline.user_code import is_piece
    rec = inputs.get("dataset")
    if not isinstance(rec, dict) or not (rec.get("name") in DATASETS or is_piece(rec.get("name"))):
        raise Refused(f"the cache records data set {rec!r}, which kdcache cannot load: no teacher check "
                      f"possible; drop --teacher")
    builtin = rec["name"] in BUILTIN or is_piece(rec["name"])  # a user's FUNCTION reads what it reads
    if builtin and args.data_root is not None:
        raise Refused(f"argument --data-root: the cache's data set {rec['name']} is built in and reads no files; "
                      f"drop --data-root")
    data_root, image_size = (None, None) if builtin else recorded_files(args, rec, sources or {})
    dataset = load_dataset(dataset_name(rec), data_root=data_root, split=rec.get("split", "train"),
                           image_size=image_size, num_classes=rec.get("num_classes"),
                           classes=None if builtin else recorded_classes(sources or {}))
    got = dataset.identity()
    differ = sorted(k for k in set(rec) | set(got) if rec.get(k) != got.get(k))
    if differ:
        shown = "; ".join(f"{k} {rec.get(k)!r} in the cache, {got.get(k)!r} here" for k in differ[:3])
        if "shape" in differ and isinstance(rec.get("shape"), list) and len(rec["shape"]) == 3:
            fix = f"pass --image-size {rec['shape'][1]}x{rec['shape'][2]} as the cache was built"
        else:
            fix = f"pass the --data-root the cache was built from (read here: {data_root})"
        raise Refused(f"the data set differs from the one the cache was built from ({shown}): {fix}")
    return dataset, augment_from_inputs(inputs), int(inputs.get("augment_seed") or 0)


def recorded_files(args, rec, sources):
    """(data root, image size) to read a file-based data set from: the cache's record, or the options
    where the cache records none (older caches) or its folder is gone."""
    from kdcache.args import Size
    what = f"{rec['name']} ({rec.get('split')}, {rec.get('length')} samples)"
    root = sources.get("data_root") if isinstance(sources.get("data_root"), str) else None
    if args.data_root is not None and root is not None and os.path.exists(root) \
            and os.path.realpath(args.data_root) != os.path.realpath(root):
        raise Refused(f"argument --data-root: the cache was built from --data-root {root}, you passed "
                      f"{args.data_root}: drop --data-root (the recorded folder is read)")
    if args.data_root is None and root is None:
        raise Refused(f"the cache was built from data set {what}, read from local files, and does not record "
                      f"where (caches built before they recorded it): pass --data-root")
    if args.data_root is None and not os.path.exists(root):
        raise Refused(f"the cache was built from data set {what} read from --data-root {root}, which is gone: "
                      f"pass --data-root where the files are now")
    if "image_size" not in sources:  # an older cache: the option, as before
        return args.data_root or root, args.image_size
    try:  # the record's [H, W], read back into the (H, W) --image-size gives, once, here
        recorded = sources["image_size"]
        if recorded is not None and len(recorded) != 2:
            raise ValueError(recorded)
        size = None if recorded is None else Size().coerce(tuple(recorded), "--image-size")
    except (TypeError, ValueError):
        raise Refused(f"the cache records image size {sources['image_size']!r}, not HxW: pass --image-size "
                      f"as the cache was built") from None
    if args.image_size is not None and tuple(args.image_size) != size:
        built = f"--image-size {size[0]}x{size[1]}" if size else "no --image-size (the images as they are)"
        raise Refused(f"argument --image-size: the cache was built with {built}, you passed --image-size "
                      f"{args.image_size[0]}x{args.image_size[1]}: drop --image-size (the recorded size is used)")
    return args.data_root or root, size


def recorded_classes(sources):
    """The --classes a cache was built with (its record, read back once into what --classes gives), or None."""
    from kdcache.args import ClassNames
    if sources.get("classes") is None:
        return None
    try:
        if not isinstance(sources["classes"], list):
            raise TypeError(sources["classes"])
        return ClassNames().coerce(tuple(map(str, sources["classes"])), "--classes")
    except (TypeError, ValueError):
        raise Refused(f"the cache records classes {sources['classes']!r}, not a list of class names: the cache "
                      f"is damaged; build it again") from None


def tolerance(fresh, dtype):
    """Per key: how far a stored logit may be from the teacher's: the storage type's rounding of
    the row's largest magnitude, plus slack for the teacher's own last-bit noise."""
    mag = np.abs(fresh).max(axis=1)
    if dtype == "float16":
        return mag * 2.0 ** -10 + 1e-3
    return mag * 1e-4 + 1e-5


RULES = {"float16": "float16 rounding: max|x| * 2^-10 + 1e-3 per key",
         "float32": "float32: max|x| * 1e-4 + 1e-5 per key",
         "int8": "int8 rounding: the row's scale / 2 + max|x| * 1e-4 + 1e-5 per key",
         "sampled": "sampled:K: the teacher's logits, drawn again with the key's seed, give the stored classes and counts"}


def rule(codec, dtype):
    """The tolerance rule of a codec and storage type, as the report names it."""
    return RULES[codec if codec in ("int8", "sampled") else dtype]


def compare_rows(stored, fresh, codec, dtype, keys=None, sampler=None):
    """Per key: (largest |stored - teacher|, tolerance, stored top-1, teacher top-1, top-1 agrees up to
    ties, within tolerance) for stored fields {name: rows} and the teacher's logits [B, C]. sampled:K
    (`sampler`, its codec; `keys`, the rows' flat keys): the draws are keyed, so the teacher's logits drawn
    again give the stored rows; the difference reported is the largest |estimate - p| (T = 1)."""
    from kdcache.store.format import schema
    from kdcache.store.format.codec import log_tail_mass, make_codec
    tol = tolerance(fresh, dtype)
    rows = np.arange(fresh.shape[0])
    best = fresh.max(axis=1)
    tie = tol  # how far below the teacher's best a stored top-1 may be and still agree (ties)
    if codec == "sampled":
        again = sampler.encode(fresh, keys=keys)
        ok = np.ones(len(fresh), dtype=bool)
        for name, rows_ in again.items():
            ok &= (np.asarray(stored[name]) == rows_).reshape(len(fresh), -1).all(axis=1)
        q = sampler.probabilities(stored)
        p = np.exp(fresh - fresh.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        diff = np.where(ok, 0.0, np.abs(q - p).max(axis=1))
        top = q.argmax(axis=1)
        return diff, np.full(len(fresh), 0.0), top, fresh.argmax(axis=1), np.ones(len(fresh), dtype=bool), ok
    if codec == "full":
        logits = stored[schema.LOGITS].astype(np.float32)
        diff = np.abs(logits - fresh).max(axis=1)
        top = logits.argmax(axis=1)
        ok = diff <= tol
    elif codec == "int8":  # every class decoded: within half a step of the row, plus the teacher's last-bit noise
        logits = make_codec("int8", fresh.shape[1]).decode(stored)
        tol = stored[schema.INT8_SCALE].astype(np.float64) / 2 + tolerance(fresh, "float32")
        diff = np.abs(logits.astype(np.float64) - fresh).max(axis=1)
        top = logits.argmax(axis=1)
        ok = diff <= tol
        tie = 2 * tol  # two classes within a step of each other may swap places
    else:
        vals = stored[schema.TOPK_VALUES].astype(np.float32)
        idx = stored[schema.TOPK_INDICES].astype(np.int64)
        at = np.take_along_axis(fresh, idx, axis=1)
        diff = np.abs(vals - at).max(axis=1)
        k = idx.shape[1]
        kth = -np.partition(-fresh, k - 1, axis=1)[:, k - 1]
        m = fresh.max(axis=1)
        lse = m + np.log(np.exp(fresh - m[:, None]).sum(axis=1))
        lse_diff = np.abs(stored[schema.TOPK_LSE].astype(np.float32) - lse)
        top = idx[:, 0]
        # the stored classes are the teacher's top K, up to ties within tolerance, and the tail's mass is right
        ok = (diff <= tol) & (at.min(axis=1) >= kth - tol) & (lse_diff <= tolerance(fresh, "float32"))
        diff = np.maximum(diff, lse_diff)
        if schema.TOPK_LOGTAIL in stored:  # the log of the tail's mass, from the classes not stored
            logtail = log_tail_mass(fresh, idx, lse)
            tail_diff = np.abs(stored[schema.TOPK_LOGTAIL].astype(np.float64) - logtail)
            ok &= tail_diff <= 2 * tolerance(fresh, "float32")
            diff = np.maximum(diff, tail_diff)
    agree = fresh[rows, top] >= best - tie
    return diff, tol, top, fresh.argmax(axis=1), agree, ok & agree


def compare(args, f, spec, topt, dataset, augment, seed):
    """Run the teacher on the sampled keys and compare with the stored rows."""
    from tqdm import tqdm

    from kdcache.pipeline.augment import make_views
    from kdcache.pipeline.teacher import load_teacher
    n_keys = spec.num_keys
    if args.sample == "all" or args.sample >= n_keys:
        keys = np.arange(n_keys, dtype=np.int64)
    else:
        keys = np.sort(np.random.default_rng(args.seed).choice(n_keys, args.sample, replace=False))
    codec = spec.make_codec()
    fields = [name for name, _, _ in codec.fields]
    teacher = load_teacher(topt, args.batch_size)
    cols = [[] for _ in range(7)]
    t0 = time.perf_counter()
    with tqdm(total=keys.size, unit="key", desc="verify", disable=args.quiet or keys.size < 2048,
              dynamic_ncols=True) as bar:
        for a in range(0, keys.size, args.batch_size):
            k = keys[a:a + args.batch_size]
            idx, views = k // spec.views, k % spec.views
            u, inv = np.unique(idx, return_inverse=True)  # h5py reads increasing, unique indices
            stored = {name: f[name][u][inv, views] for name in fields}
            x, _ = make_views(dataset, idx, views, seed=seed, augment=augment)
            # A NaN input image gives no sound target, even where the teacher repeats the stored row
            # for it: such keys count as beyond tolerance (the teacher runs on zeros in their place).
            fin = np.isfinite(x.reshape(len(x), -1)).all(axis=1)
            x = np.where(fin.reshape((-1,) + (1,) * (x.ndim - 1)), x, 0)
            res = list(compare_rows(stored, teacher.forward(x), codec.name, spec.dtype, keys=k, sampler=codec))
            res[-1] = res[-1] & fin
            for col, v in zip(cols, res + [fin]):
                col.append(v)
            bar.update(k.size)
    diff, tol, top, want, agree, ok, fin = (np.concatenate(c) for c in cols)
    worst = int(np.argmax(diff - tol))
    bad = np.flatnonzero(~ok)
    seconds = time.perf_counter() - t0

    def key(i):
        return {"sample": int(keys[i] // spec.views), "view": int(keys[i] % spec.views)}
    return {
        "teacher": {k: v for k, v in topt.identity().items() if k in ("name", "epoch", "params_sha256",
                                                                         "symbol_sha256")},
        "codec": codec.spec, "dtype": spec.dtype, "num_keys": n_keys, "keys_checked": int(keys.size),
        "sample_seed": args.seed, "max_abs_diff": float(diff.max()), "max_abs_diff_key": key(int(diff.argmax())),
        "tolerance": float(tol[int(diff.argmax())]), "tolerance_rule": rule(codec.name, spec.dtype),
        "worst_key": {**key(worst), "diff": float(diff[worst]), "tolerance": float(tol[worst])},
        "top1_agreement": float(agree.mean()), "top1_exact": float((top == want).mean()),
        "keys_beyond_tolerance": int(bad.size),
        "beyond": [{**key(i), "diff": float(diff[i]), "tolerance": float(tol[i]), "stored_top1": int(top[i]),
                    "teacher_top1": int(want[i])} for i in bad[:SHOWN]],
        "keys_with_nonfinite_inputs": int((~fin).sum()),
        "nonfinite_inputs": [key(i) for i in np.flatnonzero(~fin)[:SHOWN]],
        "match": not bad.size, "seconds": round(seconds, 3), "keys_per_s": round(keys.size / max(seconds, 1e-9), 1)}


def print_report(report):
    from kdcache.store.folder.verify import verdict
    print(f"{report['path']}: {verdict(report)}")
    for p in report["problems"] + report["suspect"]:
        print(f"  - {p}")
    t = report["teacher_check"]
    if t is None:
        print("teacher check: not run (the store's checks failed)")
        return
    what = "every key" if t["keys_checked"] == t["num_keys"] else f"random keys, seed {t['sample_seed']}"
    w = t["max_abs_diff_key"]
    print(f"teacher check: {t['keys_checked']} of {t['num_keys']} keys ({what}), teacher "
          f"{t['teacher']['name']}:{t['teacher']['epoch']}, codec {t['codec']}/{t['dtype']}")
    print(f"  max |stored - teacher|  {t['max_abs_diff']:.6g} at sample {w['sample']} view {w['view']} "
          f"(tolerance there {t['tolerance']:.3g}; {t['tolerance_rule']})")
    print(f"  top-1 agreement         {t['top1_agreement']:.4f} (exact {t['top1_exact']:.4f})")
    print(f"  keys beyond tolerance   {t['keys_beyond_tolerance']}")
    if t.get("keys_with_nonfinite_inputs"):
        shown = ", ".join(f"sample {k['sample']} view {k['view']}" for k in t["nonfinite_inputs"][:3])
        print(f"    of which {t['keys_with_nonfinite_inputs']} have input images holding NaN or Inf ({shown}): "
              f"the data set or the augmentation makes them; no teacher gives sound targets for them")
    for b in t["beyond"]:
        print(f"    sample {b['sample']} view {b['view']}: |diff| {b['diff']:.6g} > {b['tolerance']:.3g}; "
              f"top-1 stored {b['stored_top1']}, teacher {b['teacher_top1']}")
    if t["keys_beyond_tolerance"] > len(t["beyond"]):
        print(f"    ... and {t['keys_beyond_tolerance'] - len(t['beyond'])} more (--json lists the first {SHOWN})")
    if t["match"] and report["suspect"]:  # the teacher gives the same rows for the same (NaN, blank) inputs
        print(f"{report['path']}: matches its teacher, but is suspect: every row is the same (see above)")
    elif t["match"]:
        print(f"{report['path']}: matches its teacher")
    else:
        print(f"{report['path']}: does NOT match its teacher: {t['keys_beyond_tolerance']} of {t['keys_checked']} "
              f"keys checked are beyond tolerance")


if __name__ == "__main__":
    sys.exit(main())
