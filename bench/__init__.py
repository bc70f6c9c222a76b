"""`python -m bench ...`: benchmarks. Speed claims come from here, never from timed unit tests."""
