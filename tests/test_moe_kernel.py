"""The grouped matmuls for MoE experts (kernels/gpu_grouped.py's Triton kernel, megablox's gmm
through kernels/tpu_grouped.py), in Pallas interpret mode on CPU, against numpy: one matmul per
expert over its slice of the sorted rows."""

import numpy as np
import jax.numpy as jnp
import pytest

from cure_jax.models import moe
from cure_jax.models.kernels import gpu_grouped, tpu_grouped


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
  padded = np.concatenate([x, rng.normal(size=(gpu_grouped.PAD_ROWS, din)).astype(np.float32)])
  got = gpu_grouped.grouped_matmul(jnp.asarray(padded), jnp.asarray(w), jnp.asarray(sizes),
                                   interpret=True)[:len(x)]
  np.testing.assert_allclose(np.asarray(got), _numpy_grouped(x, w, sizes), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sizes", [(0, 3, 17, 0, 40, 1), (0, 0, 0, 0, 0, 33)])
def test_tpu_grouped_matmul_equals_one_matmul_per_expert(sizes):
  """megablox's gmm over rows padded to a whole row tile, contraction and columns not whole
  tiles of 128 (192, as an expert quartered over model=4)."""
  rng = np.random.default_rng(sum(sizes))
  sizes = np.asarray(sizes, np.int32)
  e, din, dout = len(sizes), 192, 192
  m = int(sizes.sum())
  rows = tpu_grouped.row_tile(m) * -(-m // tpu_grouped.row_tile(m))
  x = rng.normal(size=(rows, din)).astype(np.float32)
  w = rng.normal(size=(e, din, dout)).astype(np.float32)
  got = tpu_grouped.grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes),
                                   tokens=m, interpret=True)[:m]
  np.testing.assert_allclose(np.asarray(got), _numpy_grouped(x[:m], w, sizes), rtol=1e-4,
                             atol=1e-3)


@pytest.mark.parametrize("kernel", ["gpu", "tpu"])
def test_experts_through_the_kernel_equal_numpy_experts(kernel):
  """moe.grouped with a kernel as its matmul: each token through its own top-k experts'
  SwiGLU, as written out in numpy."""
  rng = np.random.default_rng(7)
  n, k, e, h, i = 5, 3, 8, 64, 128
  x = rng.normal(size=(n, h)).astype(np.float32)
  experts = np.stack([rng.choice(e, k, replace=False) for _ in range(n)]).astype(np.int32)
  wg, wu = (rng.normal(size=(e, h, i)).astype(np.float32) / 8 for _ in range(2))
  wd = rng.normal(size=(e, i, h)).astype(np.float32) / 8
  lib = gpu_grouped if kernel == "gpu" else tpu_grouped
  matmul = lambda *a: lib.grouped_matmul(*a, tokens=n, top_k=k, interpret=True)  # noqa: E731
  pad = gpu_grouped.PAD_ROWS if kernel == "gpu" else -(n * k) % tpu_grouped.row_tile(n * k)
  got = moe.grouped(*map(jnp.asarray, (x, experts, wg, wu, wd)), matmul=matmul, pad=pad)
  silu = lambda z: z / (1 + np.exp(-z))                                  # noqa: E731
  want = np.stack([[(silu(x[t] @ wg[j]) * (x[t] @ wu[j])) @ wd[j] for j in experts[t]]
                   for t in range(n)])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
  assert gpu_grouped.tiles(h, i) and gpu_grouped.tiles(i, h) and not gpu_grouped.tiles(h, 100)
