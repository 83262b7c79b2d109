"""A grouped matmul for MoE experts on NVIDIA GPUs as one Pallas (Triton) kernel.

`jax.lax.ragged_dot`'s contract (rows sorted by expert, group sizes [E]), written because XLA's
GPU compiler (jax 0.10.2) lowers ragged_dot densely: a masked copy of the rows per expert and one
dot over every expert, so a verify of 16 tokens reads all 128 experts of Qwen3-Coder-30B-A3B
(57.98 GB a step, compiled for an H200) where ~82 are routed to, and the copies cost more than
the weights. Here a program holds one expert's block of output columns: an expert no row routes
to returns at once, so its weights are never read; a routed expert's weights are read once per
block of 16 of its rows (once, while decoding: N tokens x top_k slots over E experts leave
about N * top_k / E rows an expert), its rows stream from the sorted input, and nothing is
copied. jax ships no GPU grouped matmul (megablox's gmm is a TPU kernel).

`swiglu` is the experts' first half in one kernel: it gathers each sorted row from the tokens
itself (by index, nothing sorted is written) and runs gate and up together, writing only
silu(gate) * up: a verify of 128 tokens x top 8 on H100 x 4 wrote and re-read a sorted copy
of the rows [1040, 2048] and gate's and up's outputs per layer, 0.69 GB an iteration.

It has no gradient and is tested on CPU in Pallas interpret mode against numpy
(tests/test_moe_kernel.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

_ROWS = 16    # rows per dot: Triton's least
_COLS = 64    # output columns per program
_DEPTH = 64   # contraction per step
NAME = "moe_grouped_"   # + "{tokens}x{top_k}": the kernel's name in the compiled program
PAD_ROWS = _ROWS                  # rows the kernel's input carries past the M real ones


def tiles(din: int, dout: int) -> bool:
  """Whether the kernel takes [E, din, dout] experts: whole column and contraction blocks."""
  return din % _DEPTH == 0 and dout % _COLS == 0


def _each_row_block(bounds_ref, body) -> None:
  """Runs body(first, valid [R, 1]) over program e's expert's sorted rows in blocks of R."""
  start, end = bounds_ref[pl.program_id(0)], bounds_ref[pl.program_id(0) + 1]

  def row_block(r, carry):
    first = start + r * _ROWS
    body(first, (first + jnp.arange(_ROWS) < end)[:, None])
    return carry

  jax.lax.fori_loop(0, pl.cdiv(end - start, _ROWS), row_block, start)


def _dot(x, w, precision):
  return jax.lax.dot_general(x, w, (((1,), (0,)), ((), ())), precision=precision,
                             preferred_element_type=jnp.float32)


def _kernel(bounds_ref, x_ref, w_ref, o_ref, *, precision):
  """One (expert e, block of output columns): the expert's rows x[start:end] [R, din] times its
  columns of w [din, C], row block by row block."""
  e = pl.program_id(0)
  din, cols = w_ref.shape[1], pl.ds(pl.program_id(1) * _COLS, _COLS)

  def row_block(first, valid):
    def depth(d, acc):
      part = pl.ds(d * _DEPTH, _DEPTH)
      x = plgpu.load(x_ref.at[pl.ds(first, _ROWS), part], mask=valid, other=0)
      return acc + _dot(x, w_ref[e, part, cols], precision)

    acc = jax.lax.fori_loop(0, din // _DEPTH, depth, jnp.zeros((_ROWS, _COLS), jnp.float32))
    plgpu.store(o_ref.at[pl.ds(first, _ROWS), cols], acc.astype(o_ref.dtype), mask=valid)

  _each_row_block(bounds_ref, row_block)


def _swiglu_kernel(bounds_ref, source_ref, x_ref, wg_ref, wu_ref, o_ref, *, precision):
  """One (expert e, block of output columns): silu(x[source] wg[e]) * (x[source] wu[e]) for the
  expert's sorted rows, the tokens gathered by index row block by row block."""
  e = pl.program_id(0)
  din, cols = wg_ref.shape[1], pl.ds(pl.program_id(1) * _COLS, _COLS)

  def row_block(first, valid):
    tokens = source_ref[pl.ds(first, _ROWS)][:, None]                    # [R, 1]

    def depth(d, accs):
      part = pl.ds(d * _DEPTH, _DEPTH)
      x = plgpu.load(x_ref.at[tokens, d * _DEPTH + jnp.arange(_DEPTH)[None, :]], mask=valid,
                     other=0)                                            # [R, DEPTH]
      return (accs[0] + _dot(x, wg_ref[e, part, cols], precision),
              accs[1] + _dot(x, wu_ref[e, part, cols], precision))

    zeros = jnp.zeros((_ROWS, _COLS), jnp.float32)
    g, u = jax.lax.fori_loop(0, din // _DEPTH, depth, (zeros, zeros))
    g, u = (a.astype(o_ref.dtype).astype(jnp.float32) for a in (g, u))  # as matmuls return them
    plgpu.store(o_ref.at[pl.ds(first, _ROWS), cols], (jax.nn.silu(g) * u).astype(o_ref.dtype),
                mask=valid)

  _each_row_block(bounds_ref, row_block)


def name(tokens: int, top_k: int) -> str:
  """The name a grouped-matmul kernel carries into the compiled program (GPU: the Triton
  kernel's; TPU: the scope of megablox's), so that costs/hlo_traffic can charge only the experts
  `tokens` tokens of top_k route to."""
  return f"{NAME}{tokens}x{top_k}"


def grouped_matmul(rows, w, sizes, *, tokens: int = 1, top_k: int = 1, interpret: bool = False):
  """rows [M + PAD_ROWS, din] sorted by expert, the last PAD_ROWS padding (a last row block
  never reaches past the array; the caller's gather writes them, saving a padded copy); w [E,
  din, dout]; sizes [E] rows per expert (summing to M) -> [M + PAD_ROWS, dout], the first M as
  jax.lax.ragged_dot(rows[:M], w, sizes). tokens and top_k (M = tokens x top_k) only name the
  kernel."""
  e, din, dout = w.shape
  return pl.pallas_call(
      functools.partial(_kernel, precision=_precision(rows.dtype)),
      out_shape=jax.ShapeDtypeStruct((rows.shape[0], dout), rows.dtype),
      grid=(e, dout // _COLS),
      in_specs=[pl.BlockSpec((e + 1,), lambda i, j: (0,)),
                pl.BlockSpec((rows.shape[0], din), lambda i, j: (0, 0)),
                pl.BlockSpec((e, din, dout), lambda i, j: (0, 0, 0))],
      out_specs=pl.BlockSpec((rows.shape[0], dout), lambda i, j: (0, 0)),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name=name(tokens, top_k),
  )(_bounds(sizes), rows, w)


def swiglu(x, source, wg, wu, sizes, *, tokens: int = 1, top_k: int = 1,
           interpret: bool = False):
  """x [N, din] the tokens; source [M + PAD_ROWS] the token of each row sorted by expert (the
  last PAD_ROWS any valid index); wg, wu [E, din, dout]; sizes [E] -> [M + PAD_ROWS, dout], the
  first M as silu(ragged_dot(x[source[:M]], wg, sizes)) * ragged_dot(x[source[:M]], wu, sizes)."""
  e, din, dout = wg.shape
  return pl.pallas_call(
      functools.partial(_swiglu_kernel, precision=_precision(x.dtype)),
      out_shape=jax.ShapeDtypeStruct((source.shape[0], dout), x.dtype),
      grid=(e, dout // _COLS),
      in_specs=[pl.BlockSpec((e + 1,), lambda i, j: (0,)),
                pl.BlockSpec(source.shape, lambda i, j: (0,)),
                pl.BlockSpec(x.shape, lambda i, j: (0, 0)),
                pl.BlockSpec((e, din, dout), lambda i, j: (0, 0, 0)),
                pl.BlockSpec((e, din, dout), lambda i, j: (0, 0, 0))],
      out_specs=pl.BlockSpec((source.shape[0], dout), lambda i, j: (0, 0)),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret, name=name(tokens, top_k),
  )(_bounds(sizes), source.astype(jnp.int32), x, wg, wu)


def _bounds(sizes):
  """[E + 1] first sorted row of each expert, then the end."""
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(sizes, dtype=jnp.int32)])


def _precision(dtype):
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None    # no TF32
