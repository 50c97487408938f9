"""kdcache trainer: the student trained on cached soft targets."""
