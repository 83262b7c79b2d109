"""Decoding's rows through a dense target on NVIDIA GPUs: a layer in five kernels, and the head's
greedy token in one.

Decoding runs each layer over a few rows (a token per batch row, a drafted block, a tree of up to
256 nodes) and is memory-bound: what it must do is read each weight once. XLA's GPU compiler made
one such layer of Qwen3-8B 24 kernels (an ar iteration on an H100: 895, compile-only, 2026-12-06): the norm's sum and
its scaling apart, a pad to two rows in front of each projection (layers.Linear keeps one-row
products GEMMs), split-K partials summed by each consumer, the q and k norms and rope apart. Inside
a CUDA graph each kernel still costs a microsecond or two. Here the layer is:

- `qkv`: the input norm, the q/k/v projections, q and k's per-head norm and rope: one program per
  head, its columns taken as two halves so that rope pairs them in registers;
- gpu_attention's kernel and its merge;
- `project` (o_proj, then down_proj): the product plus the residual;
- `swiglu`: the post-attention norm, gate and up, silu(gate) * up.

Greedy verification needs of the head only each row's largest logit: `head_argmax` takes it per
block of the vocabulary on chip, so the [rows, vocabulary] float32 logits (155 MB for a 256-node
tree of Qwen3-8B) are neither written nor read back.

Rows (up to MAX_ROWS) come in blocks of a power of two, at least 16 (Triton's smallest dot) and
at most ROW_BLOCK, loaded and stored under a mask, so no padded copy is made. Up to ROW_BLOCK
rows (a 256-node tree) each weight tile is read by one program; more rows (CURE's re-drafts at
batch 8, 640 rows; a batch of trees) are a grid axis of row blocks, the fastest-varying, so the
programs that read one weight tile run side by side and all but the first find it in L2 (the
count reads each operand once; a GPU's timing says what L2 keeps). K is summed in float32, in
steps of up to 128 (64 for blocks of 128 rows or more, so that a step's tiles fit shared
memory).
Rounding follows the XLA path's (layers.RMSNorm, Linear, Rope, SwiGLU): the projections' outputs
rounded to the model's dtype, norms and rope computed in float32 from them.
Tested in Pallas interpret mode inside the target against transformers (tests/test_gpu_layer.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from cure_jax.models.kernels.gpu_attention import dot_block as _block
from cure_jax.models.kernels.gpu_rows import largest_dividing as _largest_dividing

ROW_BLOCK = 256              # rows a program takes
MAX_ROWS = 1024              # rows a call takes, in blocks of ROW_BLOCK
_DEPTH = (128, 64, 32, 16)   # K per step: the largest that divides K (and the row block allows)
_COLS = (64, 32, 16)         # output columns per program of project, swiglu, head_argmax
_PROGRAMS = 128              # enough programs to keep an H100's 132 SMs reading


def takes(rows: int, hidden: int, intermediate: int, head_dim: int) -> bool:
  """Whether a layer of these sizes, over this many rows, runs through the kernels: a row block,
  K and N in whole tiles, and rope's halves of a head at least 16 wide, a power of two."""
  half = head_dim // 2
  return (0 < rows <= MAX_ROWS and all(_largest_dividing(n, _COLS) for n in (hidden, intermediate))
          and half >= 16 and half & (half - 1) == 0)


def _rows(m: int) -> int:
  """Rows per block: the power of two (at least 16) that holds m, up to ROW_BLOCK."""
  return min(_block(m), ROW_BLOCK)


def _columns(n: int) -> int:
  """Columns per program: the widest tile that still gives _PROGRAMS programs, else the
  narrowest."""
  return next(c for c in _COLS if n % c == 0 and (n // c >= _PROGRAMS or c == _COLS[-1]))


def _depth(k: int, rows: int) -> int:
  return _largest_dividing(k, _DEPTH[1:] if rows >= 128 else _DEPTH)


def _params(rows: int):
  return plgpu.CompilerParams(num_warps=4 if rows <= 32 else 8, num_stages=3)


def _real(m: int, rows: int):
  """How many of this program's block of rows (grid axis 0) are among the m real ones (its
  loads and stores mask the rest): m less the blocks' before it."""
  return m - pl.program_id(0) * rows


def _valid(ref, m):
  return jnp.arange(ref.shape[0])[:, None] < m                            # [R, 1]


def _load(ref, m: int, cols=slice(None)):
  return plgpu.load(ref.at[:, cols], mask=_valid(ref, m), other=0)


def _store(ref, value, m: int, cols=slice(None)):
  plgpu.store(ref.at[:, cols], value.astype(ref.dtype), mask=_valid(ref, m))


def _inverse_rms(x_ref, m: int, eps: float):
  """[R, 1] float32: 1 / rms of each row of x [R, K], K in steps."""
  rows, k = x_ref.shape
  depth = _depth(k, rows)

  def step(i, total):
    x = _load(x_ref, m, pl.ds(i * depth, depth)).astype(jnp.float32)
    return total + (x * x).sum(axis=1, keepdims=True)

  total = jax.lax.fori_loop(0, k // depth, step, jnp.zeros((rows, 1), jnp.float32))
  return jax.lax.rsqrt(total / k + eps)


def _products(x_ref, m: int, norm, columns, precision):
  """float32 [R, C] sums over K of x [R, K] times w[:, cols] for each (w_ref, cols) of columns,
  K in steps; with norm = (1 / rms [R, 1], weight ref [K]) x is RMS-normed first, rounded as
  layers.RMSNorm rounds it."""
  rows, k = x_ref.shape
  depth = _depth(k, rows)

  def step(i, accs):
    ks = pl.ds(i * depth, depth)
    x = _load(x_ref, m, ks)                                                 # [R, depth]
    if norm is not None:
      inverse, weight = norm
      x = weight[ks][None, :] * (x.astype(jnp.float32) * inverse).astype(x.dtype)
    return tuple(acc + jax.lax.dot_general(x, w[ks, cols], (((1,), (0,)), ((), ())),
                                           precision=precision,
                                           preferred_element_type=jnp.float32)
                 for acc, (w, cols) in zip(accs, columns))

  init = tuple(jnp.zeros((rows, cols.size), jnp.float32) for _, cols in columns)
  return jax.lax.fori_loop(0, k // depth, step, init)


def _precision(dtype):
  return jax.lax.Precision.HIGHEST if dtype == jnp.float32 else None       # no TF32 in float32


def _qkv_kernel(x_ref, ln_ref, wq_ref, wk_ref, wv_ref, qn_ref, kn_ref, cos_ref, sin_ref,
                q_ref, k_ref, v_ref, *, m: int, eps: float, heads: int, kv_heads: int,
                qk_norm: bool):
  """Program p: query head p, then key head p - heads, then value head p - heads - kv_heads;
  x [R, K], w [K, D] (the head's columns), cos/sin [R, D/2], out [R, D]."""
  p = pl.program_id(1)
  m = _real(m, x_ref.shape[0])
  half = q_ref.shape[1] // 2
  norm = (_inverse_rms(x_ref, m, eps), ln_ref)
  lo, hi = pl.ds(0, half), pl.ds(half, half)
  precision = _precision(x_ref.dtype)

  def head(w_ref, out_ref, head_norm, rotate):
    a, b = (y.astype(x_ref.dtype).astype(jnp.float32)                      # 2 x [R, D/2]
            for y in _products(x_ref, m, norm, ((w_ref, lo), (w_ref, hi)), precision))
    if head_norm is not None:   # layers.RMSNorm over the head's D columns
      inverse = jax.lax.rsqrt(((a * a).sum(1, keepdims=True) + (b * b).sum(1, keepdims=True))
                              / (2 * half) + eps)
      a = (head_norm[lo][None, :] * (a * inverse).astype(x_ref.dtype)).astype(jnp.float32)
      b = (head_norm[hi][None, :] * (b * inverse).astype(x_ref.dtype)).astype(jnp.float32)
    if rotate:                  # layers.Rope: rotate_half pairs column i with i + D/2
      cos, sin = _load(cos_ref, m), _load(sin_ref, m)
      a, b = a * cos - b * sin, b * cos + a * sin
    _store(out_ref, a, m, lo)
    _store(out_ref, b, m, hi)

  pl.when(p < heads)(lambda: head(wq_ref, q_ref, qn_ref if qk_norm else None, True))
  pl.when((p >= heads) & (p < heads + kv_heads))(
      lambda: head(wk_ref, k_ref, kn_ref if qk_norm else None, True))
  pl.when(p >= heads + kv_heads)(lambda: head(wv_ref, v_ref, None, False))


def qkv(x, ln, wq, wk, wv, q_norm, k_norm, cos, sin, *, eps: float, head_dim: int,
        interpret: bool = False):
  """x [M, K] (M <= MAX_ROWS, the layer's input); ln [K] the input norm's weight; wq [K, H*D],
  wk/wv [K, KVH*D] the projections' kernels; q_norm/k_norm [D] the per-head norms' weights (None
  for a model without them); cos/sin [M, D/2] float32 (Rope.phases). Returns q [M, H*D], k and v
  [M, KVH*D]: normed and rotated as the attention takes them."""
  m, k = x.shape
  d, rows = head_dim, _rows(m)
  heads, kv_heads = wq.shape[1] // d, wk.shape[1] // d
  qk_norm = q_norm is not None
  norms = (q_norm, k_norm) if qk_norm else (ln[:d], ln[:d])    # unread without per-head norms
  whole = lambda *shape: pl.BlockSpec(shape, lambda r, p: (0,) * len(shape))  # noqa: E731
  block = lambda cols: pl.BlockSpec((rows, cols), lambda r, p: (r, 0))     # noqa: E731
  q_head = lambda r, p: (0, jnp.minimum(p, heads - 1))                      # noqa: E731
  k_head = lambda r, p: (0, jnp.clip(p - heads, 0, kv_heads - 1))           # noqa: E731
  v_head = lambda r, p: (0, jnp.clip(p - heads - kv_heads, 0, kv_heads - 1))  # noqa: E731
  out_block = lambda head: lambda r, p: (r, head(r, p)[1])                  # noqa: E731
  return pl.pallas_call(
      functools.partial(_qkv_kernel, m=m, eps=eps, heads=heads, kv_heads=kv_heads,
                        qk_norm=qk_norm),
      out_shape=[jax.ShapeDtypeStruct((m, w.shape[1]), x.dtype) for w in (wq, wk, wv)],
      grid=(pl.cdiv(m, rows), heads + 2 * kv_heads),
      in_specs=[block(k), whole(k), pl.BlockSpec((k, d), q_head),
                pl.BlockSpec((k, d), k_head), pl.BlockSpec((k, d), v_head), whole(d), whole(d),
                block(d // 2), block(d // 2)],
      out_specs=[pl.BlockSpec((rows, d), out_block(f)) for f in (q_head, k_head, v_head)],
      compiler_params=_params(rows),
      interpret=interpret,
  )(x, ln, wq, wk, wv, *norms, cos, sin)


def _project_kernel(x_ref, w_ref, r_ref, out_ref, *, m: int):
  """x [R, K] times w [K, C], plus the residual r [R, C]."""
  m = _real(m, x_ref.shape[0])
  (acc,) = _products(x_ref, m, None, ((w_ref, pl.ds(0, w_ref.shape[1])),),
                     _precision(x_ref.dtype))
  _store(out_ref, _load(r_ref, m) + acc.astype(r_ref.dtype), m)


def project(x, w, residual, *, interpret: bool = False):
  """residual + x @ w: x [M, K] (M <= MAX_ROWS), w [K, N], residual [M, N] -> [M, N], the product
  rounded to the residual's dtype before the add, as `residual + Linear(x)` rounds it."""
  m, k = x.shape
  n = w.shape[1]
  cols, rows = _columns(n), _rows(m)
  return pl.pallas_call(
      functools.partial(_project_kernel, m=m),
      out_shape=jax.ShapeDtypeStruct((m, n), residual.dtype),
      grid=(pl.cdiv(m, rows), n // cols),
      in_specs=[pl.BlockSpec((rows, k), lambda r, j: (r, 0)),
                pl.BlockSpec((k, cols), lambda r, j: (0, j)),
                pl.BlockSpec((rows, cols), lambda r, j: (r, j))],
      out_specs=pl.BlockSpec((rows, cols), lambda r, j: (r, j)),
      compiler_params=_params(rows),
      interpret=interpret,
  )(x, w, residual)


def _swiglu_kernel(x_ref, ln_ref, wg_ref, wu_ref, out_ref, *, m: int, eps: float):
  """RMS-normed x [R, K] times gate and up [K, C]; silu(gate) * up."""
  m = _real(m, x_ref.shape[0])
  cols = pl.ds(0, wg_ref.shape[1])
  gate, up = (y.astype(x_ref.dtype) for y in _products(
      x_ref, m, (_inverse_rms(x_ref, m, eps), ln_ref), ((wg_ref, cols), (wu_ref, cols)),
      _precision(x_ref.dtype)))
  g = gate.astype(jnp.float32)
  _store(out_ref, (g / (1.0 + jnp.exp(-g))).astype(x_ref.dtype) * up, m)


def swiglu(x, ln, w_gate, w_up, *, eps: float, interpret: bool = False):
  """silu(norm(x) @ w_gate) * (norm(x) @ w_up): x [M, K] (M <= MAX_ROWS), ln [K] the norm's weight,
  w_gate/w_up [K, N] -> [M, N]."""
  m, k = x.shape
  n = w_gate.shape[1]
  cols, rows = _columns(n), _rows(m)
  return pl.pallas_call(
      functools.partial(_swiglu_kernel, m=m, eps=eps),
      out_shape=jax.ShapeDtypeStruct((m, n), x.dtype),
      grid=(pl.cdiv(m, rows), n // cols),
      in_specs=[pl.BlockSpec((rows, k), lambda r, j: (r, 0)),
                pl.BlockSpec((k,), lambda r, j: (0,)),
                pl.BlockSpec((k, cols), lambda r, j: (0, j)),
                pl.BlockSpec((k, cols), lambda r, j: (0, j))],
      out_specs=pl.BlockSpec((rows, cols), lambda r, j: (r, j)),
      compiler_params=_params(rows),
      interpret=interpret,
  )(x, ln, w_gate, w_up)


def head_takes(rows: int, hidden: int, vocab: int) -> bool:
  """Whether head_argmax takes these rows of a head of this size."""
  return 0 < rows <= MAX_ROWS and hidden % 16 == 0 and vocab % _COLS[-1] == 0


def _argmax_kernel(x_ref, w_ref, top_ref, arg_ref, *, m: int, by_rows: bool):
  """One block of C vocabulary entries: x [R, K] times w ([C, K] rows or [K, C] columns); each
  row's largest logit of the block and its first index."""
  rows, k = x_ref.shape
  m = _real(m, rows)
  cols = w_ref.shape[0] if by_rows else w_ref.shape[1]
  depth = _depth(k, rows)
  contract = (((1,), (1,)), ((), ())) if by_rows else (((1,), (0,)), ((), ()))

  def step(i, acc):
    ks = pl.ds(i * depth, depth)
    w = w_ref[:, ks] if by_rows else w_ref[ks, :]
    return acc + jax.lax.dot_general(_load(x_ref, m, ks), w, contract,
                                     precision=_precision(x_ref.dtype),
                                     preferred_element_type=jnp.float32)

  logits = jax.lax.fori_loop(0, k // depth, step, jnp.zeros((rows, cols), jnp.float32))
  top = logits.max(axis=1)                                                  # [R]
  ids = pl.program_id(1) * cols + jnp.arange(cols)[None, :]
  first = jnp.min(jnp.where(logits == top[:, None], ids, jnp.iinfo(jnp.int32).max), axis=1)
  valid = _valid(x_ref, m)[:, 0]
  plgpu.store(top_ref, top, mask=valid)
  plgpu.store(arg_ref, first, mask=valid)


def head_argmax(x, w, *, by_rows: bool, interpret: bool = False):
  """argmax over the vocabulary of x [M, K] (M <= MAX_ROWS) times the head w ([V, K] rows when
  by_rows, else [K, V] columns), as jnp.argmax takes it (the first of equal maxima): [M] int32.
  The logits are summed in float32 and stay on chip: each program keeps its block's maximum and
  first index, and the blocks' are compared here ([V / C, M] each)."""
  m, k = x.shape
  v = w.shape[0] if by_rows else w.shape[1]
  cols, rows = _columns(v), _rows(m)
  blocks = v // cols
  weight = (pl.BlockSpec((cols, k), lambda r, j: (j, 0)) if by_rows else
            pl.BlockSpec((k, cols), lambda r, j: (0, j)))
  part = pl.BlockSpec((pl.squeezed, rows), lambda r, j: (j, r))
  top, arg = pl.pallas_call(
      functools.partial(_argmax_kernel, m=m, by_rows=by_rows),
      out_shape=[jax.ShapeDtypeStruct((blocks, m), jnp.float32),
                 jax.ShapeDtypeStruct((blocks, m), jnp.int32)],
      grid=(pl.cdiv(m, rows), blocks),
      in_specs=[pl.BlockSpec((rows, k), lambda r, j: (r, 0)), weight],
      out_specs=[part, part],
      compiler_params=_params(rows),
      interpret=interpret,
  )(x, w)
  best = jnp.argmax(top, axis=0)                     # the first block holding a row's maximum
  return jnp.take_along_axis(arg, best[None, :], axis=0)[0]
