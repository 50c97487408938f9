"""Caches made from caches without the teacher: an ensemble of caches read per key, and convert (another
codec or dtype)."""
