"""What a run's options name, computed once per process and handed on (no MXNet).

The trainer makes its plan once, after it has started its producer (kdcache.trainer.targets):
the training split, the augmentation, the teacher's identity (a digest of its files), the cache's
spec and fingerprint, and the cache's path.
"""
import dataclasses
import os

# Data sets that MXNet decodes: loading them imports MXNet, so they wait until threads are fixed.
MXNET_DATASETS = ("recordio", "imagefolder")


def load_train(args):
    """The training split."""
    from kdcache.pipeline.datasets import load_from_options
    return load_from_options(args, "train")


@dataclasses.dataclass
class Plan:
    """The training split, the teacher, the cache spec (its fingerprint hashes the teacher's files)
    and the cache's path."""
    train: object
    augment: object
    topt: object = None
    spec: object = None
    base: str = None  # the cache's base path (the cache store)

    @property
    def complete(self):
        from kdcache.store.folder import registry
        return self.base is not None and os.path.exists(registry.final_path(self.base))


def make_plan(args):
    from kdcache.pipeline.cachespec import resolve_augment, spec_from_args
    from kdcache.pipeline.teacher_files import TeacherOptions
    from kdcache.store import path_for
    from kdcache.store.folder import registry
    train = load_train(args)
    if args.teacher_mode == "none" or getattr(args, "ensemble", None):  # an ensemble opens its caches itself
        return Plan(train, resolve_augment(args.augment, train, args.views))
    topt = TeacherOptions.from_args(args)
    spec, augment = spec_from_args(args, train, topt)
    base = registry.base_path(args.cache) if args.cache else path_for(args.cache_dir, spec.fingerprint)
    return Plan(train, augment, topt, spec, base)
