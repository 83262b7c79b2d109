"""The GPU grouped matmul for MoE experts (kernels/gpu_grouped.py), in Pallas interpret mode on
CPU, against numpy: one matmul per expert over its slice of the sorted rows."""

import numpy as np
import jax.numpy as jnp
import pytest

from cure_jax.models import moe
from cure_jax.models.kernels import gpu_grouped


def _numpy_grouped(x, w, sizes):
  ends = np.cumsum(sizes)
  return np.concatenate([x[end - n:end] @ w[e] for e, (n, end) in enumerate(zip(sizes, ends))])


@pytest.mark.parametrize("sizes", [(0, 3, 17, 0, 40, 1), (1, 1, 1, 1, 1, 1), (0, 0, 0, 0, 0, 33),
                                   (16, 0, 16, 0, 0, 0)])
def test_grouped_matmul_equals_one_matmul_per_expert(sizes):
  """Empty experts, groups under, at and over a 16-row block, the last group at the end of the
  rows (its block reaches past them)."""
  rng = np.random.default_rng(sum(sizes))
  sizes = np.asarray(sizes, np.int32)
  e, din, dout = len(sizes), 128, 192
  x = rng.normal(size=(int(sizes.sum()), din)).astype(np.float32)
  w = rng.normal(size=(e, din, dout)).astype(np.float32)
  got = gpu_grouped.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes),
                                   interpret=True)
  np.testing.assert_allclose(np.asarray(got), _numpy_grouped(x, w, sizes), rtol=1e-5, atol=1e-4)


def test_experts_through_the_kernel_equal_numpy_experts():
  """moe.grouped with the kernel as its matmul: each token through its own top-k experts'
  SwiGLU, as written out in numpy."""
  rng = np.random.default_rng(7)
  n, k, e, h, i = 5, 3, 8, 64, 128
  x = rng.normal(size=(n, h)).astype(np.float32)
  experts = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
  wg, wu = (rng.normal(size=(e, h, i)).astype(np.float32) / 8 for _ in range(2))
  wd = rng.normal(size=(e, i, h)).astype(np.float32) / 8
  matmul = lambda *a: gpu_grouped.grouped_matmul(*a, interpret=True)    # noqa: E731
  got = moe.grouped(*map(jnp.asarray, (x, experts, wg, wu, wd)), matmul=matmul)
  silu = lambda z: z / (1 + np.exp(-z))                                  # noqa: E731
  want = np.stack([[(silu(x[t] @ wg[j]) * (x[t] @ wu[j])) @ wd[j] for j in experts[t]]
                   for t in range(n)])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
  assert gpu_grouped.tiles(h, i) and gpu_grouped.tiles(i, h) and not gpu_grouped.tiles(h, 100)
