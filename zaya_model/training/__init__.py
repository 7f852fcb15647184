"""Training infrastructure shared by pretraining, fine-tuning, the server's worker and engines, and the benchmarks.

Each module is imported by its own name; this package imports nothing, so the server can use its standard-library
modules (`atomic_io`) without loading torch.
"""
