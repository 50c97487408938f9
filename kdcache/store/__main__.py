"""python -m kdcache.store: list, inspect, verify and clean the caches in a cache directory (the same as
`kdcache ls | inspect | verify | gc`; kdcache.store.command)."""
if __name__ == "__main__":
    import sys

    from kdcache.store.command import main
    sys.exit(main())
