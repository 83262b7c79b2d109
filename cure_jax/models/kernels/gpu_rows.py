"""Products whose rows do not depend on the rows beside them, on GPUs: one Pallas (Triton)
kernel with fixed tiles, for numerics=invariant.

XLA's GPU compiler picks a GEMM's tiling, and whether to split K, from the shape: a token's row
of a product can come out differently at 1 row and at 128. Here every row is computed by the same
program whatever M is: rows padded to blocks of _ROWS, each program one block of rows times one
block of the weight's rows (its output columns), K summed in blocks of a size fixed by K alone,
one after another, in float32. A row's sum is then the same sequence of the same tile products
at any M, so the same bits.

The weight is held as rows, [N, K] (numerics=invariant's layout), and read in its own dtype.
Row blocks run side by side on the grid's first axis, so programs that share a weight tile run
together (at more than _ROWS rows the tile is read once per row block, from L2 where it fits).
No split-K: at batch 1 a narrow product (K/V projections, N = 1,024) runs as N / _COLS programs.
Tested on CPU in Pallas interpret mode against numpy (tests/test_numerics.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_ROWS = 16                   # rows per program: Triton's dot takes at least 16
_COLS = (64, 32, 16)         # output columns per program: the largest that divides N
_DEPTH = (128, 64, 32, 16)   # K per step of a program's loop: the largest that divides K


def largest_dividing(n: int, sizes: tuple) -> int | None:
  """The first of sizes that divides n (sizes largest first), or None."""
  return next((s for s in sizes if n % s == 0), None)


def tiles(k: int, n: int) -> bool:
  """Whether the kernel takes a product of reduction length K into N columns."""
  return largest_dividing(k, _DEPTH) is not None and largest_dividing(n, _COLS) is not None


def _kernel(x_ref, w_ref, out_ref, *, depth: int, precision):
  """One (row block, column block): x [R, K] times w [C, K]^T, K in steps of `depth`."""
  def step(i, acc):
    ks = pl.ds(i * depth, depth)
    return acc + jax.lax.dot_general(x_ref[:, ks], w_ref[:, ks], (((1,), (1,)), ((), ())),
                                     precision=precision, preferred_element_type=jnp.float32)

  acc = jnp.zeros(out_ref.shape, jnp.float32)
  out_ref[...] = jax.lax.fori_loop(0, x_ref.shape[1] // depth, step, acc).astype(out_ref.dtype)


def product(x, rows, *, dtype=jnp.float32, interpret: bool = False):
  """x [M, K] times rows [N, K] (an [out, in] weight), summed in float32, as [M, N] in `dtype`
  (a bfloat16 layer's outputs leave the kernel at half the bytes); K and N as `tiles` takes
  them."""
  m, k = x.shape
  n = rows.shape[0]
  depth, cols = largest_dividing(k, _DEPTH), largest_dividing(n, _COLS)
  padded = -(-m // _ROWS) * _ROWS
  x = jnp.pad(x.astype(rows.dtype), ((0, padded - m), (0, 0)))                  # [M', K]
  precision = jax.lax.Precision.HIGHEST if rows.dtype == jnp.float32 else None  # no TF32
  out = pl.pallas_call(
      functools.partial(_kernel, depth=depth, precision=precision),
      out_shape=jax.ShapeDtypeStruct((padded, n), dtype),
      grid=(padded // _ROWS, n // cols),
      in_specs=[pl.BlockSpec((_ROWS, k), lambda i, j: (i, 0)),
                pl.BlockSpec((cols, k), lambda i, j: (j, 0))],
      out_specs=pl.BlockSpec((_ROWS, cols), lambda i, j: (i, j)),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=3),
      interpret=interpret,
  )(x, rows)
  return out[:m]
