"""Test-wide settings: tiny models compile faster than they run, so ask XLA not to optimise.

The suite runs on CPU even where libtpu is installed (CI installs it for test_aot_tpu, which
compiles for TPU topologies in a child process of its own: libtpu allows one process at a time).
"""

import gc
import os

import pytest

# Must happen before jax is imported by any test module. Halves compile time of the decode loops.
os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Tests compile fresh programs; a persistent cache left by an earlier run would hide compile paths.
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every module's compiled executables when it ends. The suite compiles hundreds of
  programs in one process; kept alive, their memory mappings pass vm.max_map_count and XLA:CPU
  segfaults in a later compile."""
  yield
  import jax
  from cure_jax import generation
  generation.release_compiled()
  jax.clear_caches()
  gc.collect()
