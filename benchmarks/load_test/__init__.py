"""The load test: the real stack under mixed users, then overloaded (`python -m benchmarks.load_test`)."""
