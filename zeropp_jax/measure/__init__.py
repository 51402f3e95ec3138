"""Communication reports, memory model and mesh pictures."""
