"""kdcache: knowledge distillation without paying for the teacher over and over.

The public API (imported on first use: `import kdcache` loads neither MXNet, h5py nor numpy):

    build_cache(teacher, dataset, *, views, augment, codec, dtype, cache_dir, seed, ...) -> path
        run a frozen teacher over a data set once and store its raw logits (as `kdcache cache`)
    cache_path(teacher, dataset, ...) -> path    the path that cache has, before it exists
    load_dataset(name, *, data_root, split, ...)  a data set as `kdcache cache --dataset` loads it
    CacheReader(path)                  the teacher's logits by (sample index, view); no MXNet
    EnsembleReader(caches, rule=)      several teachers' caches combined per key, read as one CacheReader
    publish(cache, dest)               a finished cache, its manifest and card to a folder or URL (kdcache publish)
    pull(src, *, cache_dir, expect_sha256)  a published cache fetched, checked and installed (kdcache pull)
    SoftTargetDataset(dataset, cache)  Gluon: items (image, label, teacher logits)
    KDLoss(temperature, alpha)         Gluon: the KD loss of (student logits, teacher logits, label)
    SoftTargetIter(dataset, reader)    Module API: batches with `softmax_label` and `soft_label`
    kd_symbol(logits, temperature=, alpha=)  Module API: the same KD loss as a training symbol
    KdcacheError                       the root of every error kdcache raises on purpose (cause and fix in
                                       its message); under it StoreError, PipelineError (data sets,
                                       augmentations, teachers), TrainError, BuildError, ShareError

The packages: store (the soft-target cache), cache_builder (the CPU teacher producer), trainer
(the student), pipeline (data sets, views, the schedule, the teacher runner), share (publishing
and pulling caches). `kdcache` is the
command line of all of them (kdcache.cli). docs/api.md shows the API at work.
"""
__version__ = "0.2.0"

# name -> the module that defines it, imported on first use (PEP 562): `python -m kdcache.X` imports
# this package before it fixes OMP_NUM_THREADS and defers signals, so nothing heavy may load here.
_PUBLIC = {
    "build_cache": "kdcache.api", "cache_path": "kdcache.api", "load_dataset": "kdcache.api",
    "BuildError": "kdcache.api",
    "publish": "kdcache.share.publish", "pull": "kdcache.share.pull", "ShareError": "kdcache.share",
    "CacheReader": "kdcache.store", "EnsembleReader": "kdcache.store",
    "SoftTargetDataset": "kdcache.trainer.softdata",
    "KDLoss": "kdcache.trainer.loss",
    "SoftTargetIter": "kdcache.trainer.dataiter", "kd_symbol": "kdcache.trainer.dataiter",
    # The errors: every one kdcache raises on purpose is a KdcacheError (kdcache.errors); each package's root
    # under it. Anything else out of kdcache is a bug in kdcache.
    "KdcacheError": "kdcache.errors", "StoreError": "kdcache.store", "PipelineError": "kdcache.pipeline.errors",
    "TrainError": "kdcache.trainer.errors",
}
__all__ = list(_PUBLIC) + ["__version__"]


def __getattr__(name):
    if name in _PUBLIC:
        import importlib
        value = getattr(importlib.import_module(_PUBLIC[name]), name)
        globals()[name] = value  # once: the next lookup does not come here
        return value
    raise AttributeError(f"module 'kdcache' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(__all__))
