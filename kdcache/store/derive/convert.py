"""kdcache convert: a cache in another codec or dtype, derived from a finished cache without the teacher.

NOTE [convert]
Every row of the source is decoded to float32 logits (what a reader returns) and written through a
CacheWriter, whose codec encodes it exactly as it encodes a teacher's output: any codec, present or
future, converts the way the producer writes it, and the result is compacted, checksummed and crash-safe
like any cache (a killed conversion resumes where it stopped). From a `full` float32 source the decoded
rows are the teacher's own float32 outputs, so the converted rows are byte for byte those a build from
the teacher writes. What a conversion would have to invent is refused in one line:
* float32 from a float16 source (its values were rounded to float16; widening them adds nothing);
* `full` or `int8` from `topk:K` (the C-K classes not stored are known only by their summed mass),
  `topk:K'` with K' > K from `topk:K`, and `full` from `int8` (its codes are 8-bit, not logits);
* anything from a codec other than full, int8 and topk (which holds what, kdcache cannot tell).
`topk:K` from `int8` is allowed: the K largest of its decoded logits, named as such by the identity.

The converted cache's identity is the source's inputs plus `converted_from` (the source's fingerprint,
codec, codec version and dtype) and its own codec: it never answers for a cache built from the teacher.

NOTE [a full disk, converting]
Before the first byte, the space the whole conversion writes (the segments of the rows still to
write, then the cache file and any spill file compaction writes beside them) is allocated in the
target folder and released again (compact.reserve, NOTE [a full disk]): a disk without room for it
is NoSpaceError, one line naming the bytes needed and free, and nothing is written. HDF5 never meets
that full disk inside a write, after which h5py's clean-up can crash the process. Should the disk
fill up during the conversion all the same (another process writing), the conversion's own output
(the target's segments) is removed, as a failed conversion's rows are cheap to write again, and the
command line leaves at once (osutil.exit_at_once) after its one line.
"""
import json
import os
import sys

from kdcache.args import Dir, Parser
from kdcache.errors import as_command, refused

from ..format.codec import make_codec
from ..write.compact import _is_full, free_space, reserve, space_needed
from ..errors import CacheNotFoundError, NoSpaceError, StoreError, WriterBusyError
from ..format.fingerprint import is_fingerprint
from ..write.settle import settle
from ..osutil import exit_at_once
from ..files.paths import base_path, compact_tmp, discard, exists, final_path, parts_path, path_for, resolve_cache_dir
from ..files.segment import count_done, final_spec, segment_bytes
from ..format.spec import CacheSpec

BLOCK_BYTES = 64 << 20  # float32 logits decoded per block


def refusal(src, tgt):
    """Why `tgt` (a codec object) cannot be derived from a cache stored with `src` without inventing
    information, with the fix; None when it can."""
    build = f"build it from the teacher instead (kdcache cache ... --codec {tgt.spec} --dtype {tgt.dtype.name})"
    if src.spec == tgt.spec and src.dtype == tgt.dtype:
        return f"the source already is codec {src.spec}, dtype {src.dtype.name}: use it as it is"
    if tgt.dtype.itemsize > src.dtype.itemsize:
        return (f"the source's values were rounded to {src.dtype.name}; dtype {tgt.dtype.name} would only widen "
                f"them: convert to --dtype {src.dtype.name}, or {build}")
    if src.name == "full":
        return None
    if tgt.name == "topk" and src.name == "int8":
        return None
    if tgt.name == "topk" and src.name == "topk":
        if tgt.k <= src.k:
            return None
        return f"the source holds the {src.k} largest logits of each row; topk:{tgt.k} needs {tgt.k}: {build}"
    holds = {"topk": f"the {getattr(src, 'k', '?')} largest logits of each row and the others' summed mass",
             "int8": "8-bit codes of each row, not its logits"}.get(src.name, f"rows in codec {src.spec}")
    return f"the source holds {holds}; codec {tgt.spec} would have to invent the rest: {build}"


def source_path(path, cache_dir=None):
    """The base path of the cache at `path` (P, P.h5, P.parts, or a fingerprint in the cache directory)."""
    base = base_path(path)
    if not exists(base) and is_fingerprint(os.path.basename(base)) and os.sep not in str(path):
        base = path_for(cache_dir, os.path.basename(base))
    if not exists(base):
        raise CacheNotFoundError(f"no cache at {path!r}: pass a path that `kdcache ls` shows (P, P.h5 or P.parts) "
                                 f"or a fingerprint in the --cache-dir")
    return base


def target_spec(src_spec, codec, dtype):
    """The converted cache's spec: the source's inputs, where it came from, and the new codec."""
    src_codec = src_spec.make_codec()
    tgt_codec = make_codec(codec, src_spec.num_classes, dtype)  # an unknown codec or dtype: one line
    why = refusal(src_codec, tgt_codec)
    if why:
        raise StoreError(f"cannot convert {src_spec.fingerprint} ({src_codec.spec}/{src_spec.dtype}) to "
                         f"{tgt_codec.spec}/{dtype}: {why}")
    inputs = dict(src_spec.inputs)
    inputs["converted_from"] = {"fingerprint": src_spec.fingerprint, "codec": src_codec.spec,
                                "codec_version": src_spec.codec_version, "dtype": src_spec.dtype}
    return CacheSpec(num_samples=src_spec.num_samples, num_classes=src_spec.num_classes, views=src_spec.views,
                     codec=tgt_codec.spec, dtype=dtype, inputs=inputs, sources=src_spec.sources)


def convert(path, codec, dtype="float16", *, cache_dir=None, memory_budget=None):
    """Write the cache `codec`/`dtype` derived from the finished cache at `path` into `cache_dir` (default: the
    source's folder). Returns a dict: cache_path (the finished .h5), fingerprint, source, source_fingerprint,
    codec, dtype, rows_written, reused."""
    from ..format.items import known
    from ..read.reader import CacheReader
    from ..write.writer import CacheWriter
    base = source_path(path, cache_dir)
    settle(base)  # every key committed but not compacted yet: compacted now
    fin = final_path(base)
    if not os.path.exists(fin):
        raise StoreError(f"{parts_path(base)}: not finished yet: finish it first (run its producer: kdcache cache "
                         f"with the options it was built with), then convert it")
    src_spec, _ = final_spec(fin, os.path.basename(base))
    spec = target_spec(src_spec, codec, dtype)
    out_dir = resolve_cache_dir(cache_dir) if cache_dir is not None else (os.path.dirname(base) or ".")
    out = path_for(out_dir, spec.fingerprint)
    result = {"cache_path": final_path(out), "fingerprint": spec.fingerprint, "source": fin,
              "source_fingerprint": src_spec.fingerprint, "codec": spec.make_codec().spec, "dtype": spec.dtype,
              "rows_written": 0, "reused": False}
    v = spec.views
    block = max(1, BLOCK_BYTES // (4 * spec.num_classes))
    with CacheReader(fin, spec=src_spec) as reader:
        if not os.path.lexists(final_path(out)):
            _reserve_space(out, spec, memory_budget)
        try:
            with CacheWriter(out, spec, memory_budget=memory_budget) as w:
                todo = w.missing()  # all of them, or what a killed conversion left
                result["reused"] = bool(w.complete)
                for a in range(0, todo.size, block):
                    keys = todo[a:a + block]
                    rec = reader.items(keys // v)  # the data set's item records travel with the rows (store.format.items)
                    w.write(keys // v, reader.get(keys // v, keys % v), views=keys % v,
                            items=rec if known(rec).all() else None)
                result["rows_written"] = w.rows_written
        except WriterBusyError:
            raise  # another conversion is writing it: its segments are not ours to remove
        except StoreError as e:
            removed = _remove_partial(out)
            if isinstance(e, NoSpaceError) or _is_full(e):
                directory = os.path.dirname(out) or "."
                raise NoSpaceError(f"{directory}: the file system filled up during the conversion ({free_space(directory)} "
                                   f"now): {'its partial output was removed; ' if removed else ''}free space on that "
                                   f"file system or pass another --cache-dir, then convert again") from None
            if removed:
                e.args = (f"{e}; the conversion's partial output was removed",)
            raise
    return result


def _remove_partial(out):
    """Remove what a failed conversion wrote (the target's segments); True if something was removed."""
    if os.path.lexists(final_path(out)):
        return False
    try:
        return discard(parts_path(out))  # only kdcache's own files; NOTE [a full disk, converting]
    except (OSError, StoreError):
        return False


def _reserve_space(out, spec, memory_budget):
    """Allocate, then release, what converting into `out` writes (NOTE [a full disk, converting])."""
    codec = spec.make_codec()
    parts = parts_path(out)
    done = count_done(parts, spec) if os.path.isdir(parts) else 0
    segments = segment_bytes(codec, spec.num_keys - done)
    final_bytes, spill_bytes = space_needed(spec, codec, memory_budget)
    total = segments + final_bytes + spill_bytes
    directory = os.path.dirname(out) or "."
    tmp = compact_tmp(final_path(out))  # compaction's temporary name: a leftover is removed as compaction's
    try:
        os.makedirs(directory, exist_ok=True)
        reserve(tmp, total)
    except OSError as e:
        if not _is_full(e):
            raise StoreError(f"{directory}: cannot write there ({e.strerror or e}): make it writable or pass "
                             f"another --cache-dir") from None
        raise NoSpaceError(f"{directory}: no space left for the converted cache: it needs about {total:,} bytes "
                           f"there ({segments:,} for its rows while they are written, {final_bytes + spill_bytes:,} "
                           f"for the cache file compacted from them) and {free_space(directory)}: free space on that "
                           f"file system or pass another --cache-dir, then convert again; nothing was written"
                           ) from None
    finally:
        try:
            os.unlink(tmp)
        except OSError:
            pass


@as_command  # a KdcacheError is one line and exit 2; anything else shows as the bug it is
def main(argv=None, prog="python -m kdcache.store.derive.convert"):
    p = Parser(prog=prog, description=(
        "Write a cache in another codec or dtype from a finished cache, without running the teacher: every row "
        "is decoded and encoded again as the producer encodes a teacher's output (from a full float32 cache, "
        "the same bytes as a build from the teacher). Lossless from full; refused where it would have to "
        "invent information (float32 from float16, full or int8 from topk:K, topk:K' from topk:K with K' > K, "
        "full from int8). The new cache is named by its own fingerprint, made from the source's inputs, the "
        "source's fingerprint and codec, and the new codec: it prints the new cache's path (--json: one JSON "
        "line with cache_path, fingerprint, source_fingerprint, rows_written, reused). Running it again "
        "reuses the converted cache, or finishes one a kill interrupted."))
    p.add_argument("cache", help="the source cache: P, P.h5, P.parts (once complete) or a fingerprint in --cache-dir")
    p.add_argument("--codec", required=True, help="full | topk:K | int8 | any codec `kdcache cache --codec` takes")
    p.add_argument("--dtype", default="float16", choices=("float16", "float32"),
                   help="storage type of the new cache's values (default float16; int8 takes float16 only)")
    p.add_argument("--cache-dir", type=Dir(), help="where the new cache goes (default: the source's folder); "
                                                   "also where a fingerprint given as CACHE is looked up")
    p.add_argument("--json", action="store_true", help="one JSON line instead of the path")
    args = p.parse_args(argv)
    try:
        result = convert(args.cache, args.codec, args.dtype, cache_dir=args.cache_dir)
    except StoreError as e:
        exit_at_once(refused(e))  # NOTE [a full disk, converting]
    if args.json:
        print(json.dumps(result))
    else:
        how = "reused" if result["reused"] else f"{result['rows_written']} rows written"
        print(f"{result['source']} ({result['source_fingerprint']}) -> {result['codec']}/{result['dtype']}: {how}",
              file=sys.stderr)
        print(result["cache_path"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
