"""Filling a cache: CacheWriter (one producer's segment), compaction into the finished file, and settling
what a crash left."""
