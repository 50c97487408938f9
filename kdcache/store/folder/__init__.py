"""The cache directory as a whole: ls, inspect and gc (registry), verify, and the stale files dead
processes left."""
