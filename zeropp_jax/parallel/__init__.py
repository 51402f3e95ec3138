"""Sequence parallelism (Ulysses)."""
