"""Reading a cache: CacheReader (finished or being filled), the read-only map of a finished file, and the
demand files by which readers tell producers what they wait for."""
