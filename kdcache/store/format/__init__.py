"""What a cache file holds and how it is named: the format (schema), the spec and fingerprint, the codecs,
the item records, the seal, the checksums, and the checks a reader makes of the metadata (validate)."""
