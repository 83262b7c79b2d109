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


# `pytest -n 2 --dist loadgroup` (the README's command): a file whose tests share a costly module
# fixture or a lock (libtpu; two notebook kernels starting at once can race for a port) stays on
# one worker; these files' tests are spread one by one.
_SPREAD = {"test_lossless", "test_sampling", "test_best_first", "test_budget",
           "test_tree", "test_redraft", "test_replay", "test_host_sync", "test_chex_invariants",
           "test_multiprocess", "test_numerics"}


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook, which reads the marks
def pytest_collection_modifyitems(items):
  """Groups tests for xdist, and starts the notebooks (the longest single tests) first so that
  no worker is left finishing one alone at the end."""
  for item in items:
    module = item.module.__name__.rsplit(".", 1)[-1]
    if module not in _SPREAD:
      item.add_marker(pytest.mark.xdist_group(module))
  items.sort(key=lambda item: item.module.__name__ != "tests.test_notebooks")


@pytest.fixture(autouse=True, scope="module")
def _release_compiled_programs():
  """Drops every module's compiled executables when it ends. The suite compiles hundreds of
  programs in one process; kept alive, their memory mappings pass vm.max_map_count and XLA:CPU
  segfaults in a later compile."""
  yield
  import jax
  from cure_jax.runtime import generation
  generation.release_compiled()
  jax.clear_caches()
  gc.collect()
