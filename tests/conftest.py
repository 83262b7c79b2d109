"""Test-wide settings: tiny models compile faster than they run, so ask XLA not to optimise.

The suite runs on CPU even where libtpu is installed (CI installs it for test_aot_tpu, which
compiles for TPU topologies in a child process of its own: libtpu allows one process at a time).
"""

import gc
import os
import shutil
import tempfile

import pytest

# Must happen before jax is imported by any test module. Halves compile time of the decode loops.
os.environ["XLA_FLAGS"] = " ".join(
    filter(None, [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]))
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# Many tests compile the same programs (random models of one shape, seed after seed): a
# persistent cache of this run's own, made by the main process and shared with its xdist workers
# (they inherit its environment), compiles each once (one test of random pairs: 72 s -> 56 s).
# Never an earlier run's: that would hide compile paths.
_WORKER = "PYTEST_XDIST_WORKER" in os.environ
if not _WORKER:
  os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="cure_jax_tests_xla_")
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "true"
os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"] = "0"
os.environ["JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES"] = "-1"


# `pytest -n 2 --dist loadgroup` (the README's command): a file whose tests share a costly module
# fixture or a lock (libtpu; two notebook kernels starting at once can race for a port) stays on
# one worker; these files' tests are spread one by one.
_SPREAD = {"test_lossless", "test_sampling", "test_best_first", "test_budget",
           "test_tree", "test_redraft", "test_replay", "test_host_sync", "test_chex_invariants",
           "test_multiprocess", "test_numerics", "test_device_costs"}


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


def pytest_unconfigure(config):
  """The main process removes the run's compilation cache."""
  if not _WORKER:
    shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
