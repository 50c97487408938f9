"""bench.fleet: the cache filled as immutable parts by Ray actors, against the local producer at equal cores."""
