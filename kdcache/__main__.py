"""python -m kdcache: the same as the `kdcache` command."""
import sys

from kdcache.cli import entry

sys.exit(entry())
