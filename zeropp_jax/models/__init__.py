"""Reference models used by the examples, benchmarks and tests."""
