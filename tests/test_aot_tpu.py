"""The decode loop compiled by XLA's real TPU compiler (libtpu, compile-only devices, no TPU).

A small random pair, big enough that its weights do not fit in on-chip memory, is compiled for
v5e 2x2 with tensor parallelism 4 by `experiments.aot` in a child process: libtpu takes a lock
file, so one process holds it alone, and the rest of the suite stays on CPU (conftest sets
JAX_PLATFORMS=cpu). Fails when one ar iteration reads more than 1.2x the per-chip weights from
HBM, or when the collectives per layer change (tensor parallelism needs two all-reduces per
layer, after o_proj and down_proj, plus a few for the vocabulary-parallel head), or when a
layer's attention stops being one TPU kernel (tpu_attention: without it, v5p wrote every
layer's attention scores to HBM and read them back twice).
"""

import fcntl
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cure_jax.analysis import random_models
from tests import aot_child

LOCK = Path(os.environ.get("TMPDIR", "/tmp")) / "cure_jax_libtpu.lock"
# ~290 MB of bf16 weights per chip over 4 chips, more than v5e's 128 MiB of on-chip memory, and
# a 2048-slot cache of ~25 MB per chip: one relayout copy of it per iteration breaks the bound.
# (At this size XLA stages each layer's cache in on-chip memory beside the attention kernel and
# writes it back, 2x the cache an iteration; at 4096 slots that alone reached 1.21x the weights.
# For Qwen3-8B it reads the cache once: WORKSPACE.md, "2026-12-01 — TPU attention as one
# Pallas kernel per layer".)
MAX_LEN = 2048
ARCH = random_models.Arch(vocab=32768, hidden=2048, layers=12, heads=16, kv_heads=8,
                          head_dim=128, draft_layers=2, block_size=8, target_layer_ids=(1, 10))
HEAD_COLLECTIVES = 3     # all-reduces of the vocabulary-parallel head / argmax / embedding


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
  if importlib.util.find_spec("libtpu") is None:
    msg = 'libtpu is not installed (pip install "jax[tpu]==<jax version>"; .ci/run does)'
    print(f"SKIP test_aot_tpu: {msg}")
    pytest.skip(msg)
  root = tmp_path_factory.mktemp("aot")
  flags = ["--topology=v5e:2x2", "--config.mesh.model=4", "--methods=ar,chain", "--batch=1",
           "--programs=decode", f"--max_len={MAX_LEN}", "--prompt_len=64"]
  with open(LOCK, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)   # one libtpu process at a time on this machine
    records = aot_child.compile_pair(sys.executable, root, ARCH, flags, aot_child.child_env())
  return {r["case"]: r for r in records}


def test_ar_iteration_reads_each_weight_about_once(compiled):
  ar = compiled["decode/ar/b1"]
  weights = ar["weights"]["target"]
  assert weights > 250e6
  hbm = ar["iteration"]["hbm_bytes"]
  assert hbm <= 1.2 * weights, (hbm / weights, ar["iteration"]["largest"][:5])
  layers = weights - 2 * ARCH.vocab * ARCH.hidden * 2 / 4     # without embedding and head
  assert ar["iteration"]["by_label"]["target_weights"] > 0.5 * layers   # most come from HBM
  assert ar["donated_state_aliased"]


def test_collectives_per_layer(compiled):
  ar = compiled["decode/ar/b1"]["iteration"]["collectives"]
  assert ar == {"all-reduce": 2 * ARCH.layers + HEAD_COLLECTIVES}
  chain = compiled["decode/chain/b1"]["iteration"]["collectives"]
  assert chain["all-reduce"] == 2 * (ARCH.layers + ARCH.draft_layers) + HEAD_COLLECTIVES
  assert chain.get("all-gather", 0) <= 6        # cache commits; none per layer
  assert set(chain) <= {"all-reduce", "all-gather"}


def test_attention_is_one_kernel_per_layer(compiled):
  assert compiled["decode/ar/b1"]["iteration"]["kernels"] == ARCH.layers
  chain = compiled["decode/chain/b1"]["iteration"]["kernels"]
  assert chain == ARCH.layers + ARCH.draft_layers          # verification + one drafter pass


_EXACT_CHILD = """
import sys
import jax, jax.numpy as jnp
from jax.experimental import topologies
from cure_jax.models.kernels import tpu_exact_attention
device = topologies.get_topology_desc("v5e:2x2", "tpu").devices[0]
one = jax.sharding.SingleDeviceSharding(device)
for b, t, s in ((1, 1, 2048), (8, 16, 2048), (1, 100, 1024)):   # a step, a block, a tree
  kvh, h, d = 2, 8, 128
  arg = lambda *dims, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(dims, dtype, sharding=one)
  args = (arg(b, 1, t, h, d), arg(b, kvh, s, d), arg(b, kvh, s, d), arg(b, 1, t, kvh, d),
          arg(b, 1, t, kvh, d), arg(b, 1, t, s, dtype=bool), arg(b, 1, t, t, dtype=bool),
          arg(kvh * d, dtype=jnp.int32))
  text = jax.jit(tpu_exact_attention.attend).lower(*args).compile().as_text()
  print(b, t, s, text.count('custom_call_target="tpu_custom_call"'))
"""


def test_the_exact_attention_kernel_compiles_for_a_tpu():
  """numerics=invariant's TPU attention (tpu_exact_attention) through Mosaic, XLA's real TPU
  compiler, for one decoding row, a 16-row block at batch 8 and a 100-node tree (rows padded
  to whole blocks): one kernel each. Interpret mode on CPU (tests/test_numerics.py) checks its
  sums, not that Mosaic takes its layouts."""
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip('libtpu is not installed (pip install "jax[tpu]==<jax version>"; .ci/run does)')
  with open(LOCK, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)   # one libtpu process at a time on this machine
    run = subprocess.run([sys.executable, "-c", _EXACT_CHILD], env=aot_child.child_env(),
                         capture_output=True, text=True, timeout=600)
  assert run.returncode == 0, run.stderr[-3000:]
  counts = [line.split() for line in run.stdout.splitlines()]
  assert [c[:3] for c in counts] == [["1", "1", "2048"], ["8", "16", "2048"], ["1", "100", "1024"]]
  assert all(c[3] == "1" for c in counts), counts


_HOLD_LIBTPU = """
import sys
from jax.experimental import topologies
topologies.get_topology_desc("v5e:2x2", "tpu")   # libtpu starts and takes its lock file
print("holding", flush=True)
sys.stdin.read()
"""


def test_a_second_libtpu_process_is_told_libtpu_is_in_use(tmp_path):
  """experiments.aot while another process holds libtpu: one `error:` line naming that process
  and libtpu's lock file, not "unknown TPU topology"."""
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip('libtpu is not installed (pip install "jax[tpu]==<jax version>"; .ci/run does)')
  env = aot_child.child_env(JAX_PLATFORMS="cpu")
  with open(LOCK, "w") as lock:
    fcntl.flock(lock, fcntl.LOCK_EX)   # one libtpu process at a time on this machine: ours
    holder = subprocess.Popen([sys.executable, "-c", _HOLD_LIBTPU], env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
      assert holder.stdout.readline() == "holding\n"
      run = subprocess.run([sys.executable, "-m", "experiments.aot", "--topology=v5e:2x2",
                            f"--output={tmp_path / 'out'}"], cwd=aot_child.REPO, env=env,
                           capture_output=True, text=True, timeout=600)
    finally:
      holder.communicate("")
  assert run.returncode == 2, run.stderr[-3000:]
  said = run.stderr.strip().splitlines()[-1]
  assert said.startswith(f"error: libtpu is in use by another process (pid {holder.pid}): "), said
  assert "/tmp/libtpu_lockfile" in said and "Wait for that process to end, or stop it" in said
  assert "Traceback" not in run.stderr
