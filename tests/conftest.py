"""Test-wide settings: tiny models compile faster than they run, so ask XLA not to optimise."""

import os

# Must happen before jax is imported by any test module. Halves compile time of the decode loops.
os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]))
