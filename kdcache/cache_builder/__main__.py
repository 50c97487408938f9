"""python -m kdcache.cache_builder: run a frozen teacher on the CPU and fill the soft-target cache (the
same as `kdcache cache`; kdcache.cache_builder.command)."""
if __name__ == "__main__":
    from kdcache import signals as _signals
    _signals.defer()  # first, before anything heavy is imported: signals at safe points only
    import sys

    from kdcache.cache_builder.command import main
    sys.exit(main())
