"""python -m kdcache.trainer: train a student on cached soft targets, or inline KD, or hard labels (the same as
`kdcache train`; kdcache.trainer.command)."""
if __name__ == "__main__":
    from kdcache import signals as _signals
    _signals.defer()  # first, before anything heavy is imported: signals at safe points only
    import sys

    from kdcache.trainer.command import main
    sys.exit(main())
