"""kdcache cache_builder: the CPU teacher producer that fills the store."""
