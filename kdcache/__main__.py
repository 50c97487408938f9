"""python -m kdcache: the same as the `kdcache` command."""
if __name__ == "__main__":
    import sys

    from kdcache.cli import entry
    sys.exit(entry())
