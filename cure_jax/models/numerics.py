"""Numerics modes of the target's forward pass.

"default": each product as the platform computes it fastest. Its reductions follow the shapes:
XLA:CPU multiplies one row by a matrix through a GEMV and two or more through YNNPACK's GEMM
(the sums come out differently), vectorises a row-wise norm across rows from 8 rows on, and
attention sums the cache and the new tokens apart. So a token's logits depend, in the last bits,
on how many rows were computed beside it (batch, tree nodes, a prefill chunk) and on where its
context's keys lie (cache or new tokens), and greedy decoding can flip at near-ties.

"invariant": the logits of a sequence at position p are a function of its tokens up to p alone,
bitwise, whatever else is computed with them:
- matmuls on CPU run on row tiles of MIN_ROWS..MAX_ROWS rows, each tile one product taken
  weight-first over the weight's [out, in] rows: XLA:CPU computes every row of such a product
  the same way (tests/test_numerics.py proves it for the embedded default's shapes; one row
  alone is padded to two). The kernel a product takes depends on its reduction length too: at
  K = 4,096 rows stay invariant up to 8 per tile, at 12,288 up to 3 (measured, jax 0.10.2);
  the tile sizes here are the embedded default's. On an NVIDIA GPU (one device) every product
  is gpu_rows' kernel, whose tiles do not depend on the number of rows; on a TPU it is one
  product for all rows (the matrix unit's fixed passes over K);
- norms sum their squares as an explicit pairwise tree of elementwise adds (each add is IEEE,
  the same in any vectorisation);
- attention computes each score as an explicit tree over the head dimension (on a TPU a dot on
  the matrix unit), takes the maximum over the visible keys (exact in any order), and sums the
  softmax's weights and weighted values exactly: every term is cut to a common grid
  (pre-rounding, as in Demmel & Nguyen's reproducible summation) and summed as integers (int64;
  int32 limbs on TPUs), so the sum is the same in any order and any split between cache and new
  tokens. The values' grid is set by a bound taken from the layer's weights (value_exponents),
  the same for every token, so no pass over the cache finds it. On an NVIDIA GPU (one device)
  all of it is gpu_exact_attention's kernel, on a TPU tpu_exact_attention's.
What runs on GPUs and TPUs is compiled here, not run: their row invariance rests on fixed tiles
(and, on TPUs, on XLA's dots) computing each entry the same way wherever it lies in a tile, which
a device has to confirm.
The mode is a trace-time setting (`with numerics.mode("invariant"):`), entered by the target's
forward pass; a mesh changes how each product is split, so invariance holds for one mesh.
"""

from __future__ import annotations

import contextlib
import functools
import math

import jax
import jax.numpy as jnp

from cure_jax.models.kernels import blocks, gpu_exact_attention, gpu_rows, tpu_exact_attention

MODES = ("default", "invariant")
MIN_ROWS, MAX_ROWS = 2, 16   # rows per matmul tile in invariant mode (XLA:CPU: tests/test_numerics)
_NEG = float(jnp.finfo(jnp.float32).min)
_mode = ["default"]


@contextlib.contextmanager
def mode(name: str):
  """Traces the enclosed computation in numerics mode `name` (one of MODES)."""
  if name not in MODES:
    raise ValueError(f"numerics={name!r}: expected one of {', '.join(MODES)}")
  _mode.append(name)
  try:
    yield
  finally:
    _mode.pop()


def invariant() -> bool:
  return _mode[-1] == "invariant"


def matmul(x, rows, dtype=jnp.float32):
  """x [..., K] times weight rows [N, K] (an [out, in] kernel, a head's vocabulary rows), summed
  in float32, as [..., N] in `dtype`, each row the same whatever rows are beside it: on NVIDIA
  GPUs through gpu_rows' fixed tiles (on one device; under a mesh as below), which cast in the
  kernel; on TPUs as one product (_one_product); elsewhere as _row_tiles."""
  lead, k = x.shape[:-1], x.shape[-1]
  flat = x.reshape(-1, k)
  cast = lambda product: lambda *a: product(*a).astype(dtype)   # noqa: E731
  platforms = dict(tpu=cast(_one_product), default=cast(_row_tiles))
  if gpu_rows.tiles(k, rows.shape[0]) and blocks.one_device():
    platforms["cuda"] = functools.partial(gpu_rows.product, dtype=dtype)
  return jax.lax.platform_dependent(flat, rows, **platforms).reshape(lead + (-1,))


def _one_product(x, rows):
  """x [M, K] times rows [N, K] in float32 as one product, whatever M. A TPU's matrix unit sums
  each output entry over K in passes of its fixed size, in order, the same for every row (an
  assumption a TPU has to confirm, as _row_tiles' tiles assume it of XLA:TPU at 2-16 rows);
  _row_tiles' map over 16-row tiles read every weight once per tile (Qwen3-8B chain at batch 8
  on a v5e 2x2: 8 reads an iteration)."""
  return jnp.einsum("mk,nk->mn", x, rows, preferred_element_type=jnp.float32,
                    precision=jax.lax.Precision.HIGHEST)


def _row_tiles(x, rows):
  """x [M, K] times rows [N, K] in float32: x's rows computed in tiles of MIN_ROWS..MAX_ROWS,
  each tile one product taken weight-first (rows x tile^T, the weight read as it lies; the
  tile's columns come back transposed)."""
  n, k = x.shape
  flat = x.astype(jnp.float32)
  w = rows.astype(jnp.float32)
  product = lambda t: jax.lax.optimization_barrier(jnp.einsum("nk,mk->nm", w, t)).T  # noqa: E731
  if n <= MAX_ROWS:
    padded = jnp.pad(flat, ((0, max(MIN_ROWS - n, 0)), (0, 0)))
    return product(padded)[:n]
  tiles = -(-n // MAX_ROWS)
  padded = jnp.pad(flat, ((0, tiles * MAX_ROWS - n), (0, 0)))
  out = jax.lax.map(product, padded.reshape(tiles, MAX_ROWS, k))
  return out.reshape(tiles * MAX_ROWS, -1)[:n]


def tree_sum(x, axis: int = -1):
  """Sum over `axis` as a fixed tree of elementwise adds: halves while the length is even, then
  the rest one by one."""
  x = jnp.moveaxis(x, axis, 0)
  while x.shape[0] > 1 and x.shape[0] % 2 == 0:
    half = x.shape[0] // 2
    x = x[:half] + x[half:]
  total = x[0]
  for i in range(1, x.shape[0]):
    total = total + x[i]
  return total


# exact sums: terms cut toward zero to the grid 2^(e - _GRID) of their common bound 2^e and
# summed as int64 integers, exact for up to 2^(63 - _GRID) terms
_GRID = 44
MAX_TERMS = 2 ** (63 - _GRID)


def _exact_sum(parts, e, axis: int):
  """The sum over `axis` of every x in parts (|x| < 2^e, e broadcast to the sum's shape) as
  float32: each term is cut toward zero to the grid 2^(e - _GRID), t = trunc(x 2^(_GRID - e)),
  and the integers are summed exactly, so in any order and any split between the parts. On TPUs
  in int32 limbs (_limb_sum: TPUs have no int64 arithmetic, XLA emulates it), elsewhere in
  int64."""
  axis = axis % parts[0].ndim
  scale = _power_of_two(_GRID - jnp.expand_dims(e, axis))
  total = jax.lax.platform_dependent(
      scale, *parts, tpu=functools.partial(_limb_sum, axis=axis),
      default=functools.partial(_int64_sum, axis=axis))
  return total * _power_of_two(e - _GRID)


def _int64_sum(scale, *parts, axis: int):
  """sum(trunc(x scale)) over `axis`, summed as int64 and rounded once to float32. A float32
  times a power of two, converted to int64, is the one step per term (XLA:CPU vectorises both;
  three int32 limbs of 15 bits took 3-6x longer for the embedded default's attention)."""
  with jax.enable_x64(True):
    total = sum((x * scale).astype(jnp.int64).sum(axis) for x in parts)
    return total.astype(jnp.float32)


_HALF, _BLOCK = 22, 512   # a term's halves; terms per int32 partial sum (2^22 x 2^9 < 2^31)


def _limb_sum(scale, *parts, axis: int):
  """_int64_sum in int32 alone. Each term t (|t| < 2^44) is high 2^22 + low (both of t's sign,
  below 2^22), each half summed in blocks of _BLOCK terms (below 2^31), each block's sum split
  into 16-bit digits, and the digits summed over the blocks (below 2^26 for MAX_TERMS terms).
  The four sums are then carried into one canonical form, y3 2^38 + d2 2^22 + d1 2^16 + d0 with
  the d's in fixed ranges, so the float32 it becomes (a fixed sequence of roundings) is a
  function of the exact integer alone, whatever the blocks held."""
  digits = [0, 0, 0, 0]      # sum high // 2^16, high % 2^16, low // 2^16, low % 2^16
  for x in parts:
    t = x * scale
    high = (t * 2.0 ** -_HALF).astype(jnp.int32)
    low = (t - high.astype(jnp.float32) * 2.0 ** _HALF).astype(jnp.int32)   # exact
    for i, block in enumerate(_block_sums(high, low, axis=axis)):   # the blocks at `axis`
      quotient = jax.lax.shift_right_arithmetic(block, 16)
      digits[2 * i] = digits[2 * i] + quotient.sum(axis)
      digits[2 * i + 1] = digits[2 * i + 1] + (block - (quotient << 16)).sum(axis)
  top, high_rest, low_top, low_rest = digits  # weights 2^38, 2^22, 2^16, 1
  d0, carry = low_rest & 0xFFFF, jax.lax.shift_right_arithmetic(low_rest, 16)
  y1 = low_top + carry
  d1, carry = y1 & 0x3F, jax.lax.shift_right_arithmetic(y1, 6)
  y2 = high_rest + carry
  d2, carry = y2 & 0xFFFF, jax.lax.shift_right_arithmetic(y2, 16)
  y3 = top + carry
  f = lambda v: v.astype(jnp.float32)   # noqa: E731
  return ((f(y3) * 2.0 ** 16 + f(d2)) * 2.0 ** 6 + f(d1)) * 2.0 ** 16 + f(d0)


def _block_sums(*xs, axis: int):
  """Each x's sums over `axis` in blocks of _BLOCK (zeros past its end), the blocks left at
  `axis`; one reduction for all of xs, so their common producer is read once."""
  n = xs[0].shape[axis]
  block = max(min(n, _BLOCK), 1)
  pad = [(0, 0)] * xs[0].ndim
  pad[axis] = (0, -n % block)
  blocked = tuple(jnp.pad(x, pad).reshape(x.shape[:axis] + (-1, block) + x.shape[axis + 1:])
                  for x in xs)
  zeros = tuple(jnp.zeros((), x.dtype) for x in xs)
  return jax.lax.reduce(blocked, zeros, lambda a, b: tuple(u + v for u, v in zip(a, b)),
                        (axis + 1,))


def _power_of_two(n):
  """2.0 ** n for integer n (exact), built from the exponent bits rather than a power."""
  n = jnp.clip(n, -126, 127)
  return jax.lax.bitcast_convert_type((n + 127).astype(jnp.int32) << 23, jnp.float32)


def value_exponents(v_rows, norm_weight):
  """e [N] int32 with |v_j| < 2^e_j for every value v_j = v_rows[j] . (rmsnorm(x) * norm_weight)
  a layer can compute, whatever x is: each entry of rmsnorm(x) is at most sqrt(H) in size (all
  of x's energy in one entry), so |v_j| <= sqrt(H) sum_i |v_rows[j, i] norm_weight_i|, doubled
  for the rounding of the products and casts. The exact sums' grid follows this bound rather
  than the largest visible value: it needs no pass over the cache (that pass read the values a
  second time each layer), and every row and every step has the same grid. The bound is loose
  by about H (the weights' 1-norm against their 2-norm, times sqrt(H)); the grid sits 2^-44
  below it, still far below float32's rounding of the output."""
  terms = jnp.abs(v_rows.astype(jnp.float32)) * jnp.abs(norm_weight.astype(jnp.float32))
  bound = 2.0 * math.sqrt(norm_weight.shape[0]) * tree_sum(terms)   # [N]
  _, e = jnp.frexp(bound)
  return jnp.maximum(e, _GRID - 126)   # a bound below 2^-82 is taken as 2^-82 (a finite scale)


def attend(q, k_old, v_old, k_new, v_new, mask_old, mask_new, exponents):
  """layers.attend in invariant mode (shapes there), with exponents [KVH * D] or [KVH, D]
  bounding every value |v| < 2^e (value_exponents); exact in any order and any split of the keys
  between cache and new tokens, for up to MAX_TERMS keys. On NVIDIA GPUs (one device)
  gpu_exact_attention's kernel, on TPUs tpu_exact_attention's (for caches in whole blocks of its
  keys); elsewhere _elementwise_attend."""
  if k_old.shape[2] + k_new.shape[2] > MAX_TERMS:
    raise ValueError(f"numerics=invariant attends at most {MAX_TERMS} keys exactly; the cache "
                     f"holds {k_old.shape[2]} and {k_new.shape[2]} new: lower max_len")
  args = (q, k_old, v_old, k_new, v_new, mask_old, mask_new, exponents)
  platforms = {}
  if gpu_exact_attention.tiles(k_old.shape[2], q.shape[3] // k_old.shape[1], q.shape[4]) and (
      blocks.one_device()):
    platforms["cuda"] = gpu_exact_attention.attend
  if tpu_exact_attention.tiles(k_old.shape[2]):
    platforms["tpu"] = tpu_exact_attention.attend
  if not platforms:
    return _elementwise_attend(*args)
  return jax.lax.platform_dependent(*args, **platforms, default=_elementwise_attend)


def _elementwise_attend(q, k_old, v_old, k_new, v_new, mask_old, mask_new, exponents):
  """attend as XLA tensors: every score and weighted value is elementwise work, rows x keys x
  head size, with no matmul library."""
  q, k_new, v_new = _materialized(q, k_new, v_new)
  b, a, t, h, d = q.shape
  kvh = k_old.shape[1]
  qg = q.reshape(b, a, t, kvh, h // kvh, d)                          # [B, A, T, KVH, G, D]
  vo = v_old[:, None, None, :, None].astype(jnp.float32)                # [B, 1, 1, KVH, 1, S, D]
  vn = v_new.transpose(0, 1, 3, 2, 4)[:, :, None, :, None].astype(jnp.float32)  # [B,A,1,KVH,1,U,D]
  seen_old = mask_old[:, :, :, None, None]                              # [B, A, T, 1, 1, S]
  seen_new = mask_new[:, :, :, None, None]
  scale = 1.0 / math.sqrt(d)
  s_old, s_new = jax.lax.platform_dependent(qg, k_old, k_new, tpu=_mxu_scores,
                                            default=_tree_scores)
  s_old = jnp.where(seen_old, s_old * scale, _NEG)                    # [B, A, T, KVH, G, S]
  s_new = jnp.where(seen_new, s_new * scale, _NEG)
  top = jnp.maximum(s_old.max(-1, initial=_NEG), s_new.max(-1, initial=_NEG))[..., None]
  p_old = jnp.where(seen_old, jnp.exp(s_old - top), 0.0)
  p_new = jnp.where(seen_new, jnp.exp(s_new - top), 0.0)
  one = jnp.ones(top.shape[:-1], jnp.int32)                               # p <= 1 < 2^1
  total = _exact_sum((p_old, p_new), one, -1)                            # [B, A, T, KVH, G]
  e = exponents.reshape(1, 1, 1, kvh, 1, d)                          # the columns' grids
  p_old, p_new = _materialized(p_old, p_new)
  sums = _exact_sum((p_old[..., None] * vo, p_new[..., None] * vn), e, -2)  # [B,A,T,KVH,G,D]
  out = sums / jnp.where(total > 0, total, 1.0)[..., None]
  return out.reshape(b, a, t, h, d).astype(q.dtype)


def _tree_scores(qg, k_old, k_new):
  """q . k for the cache's keys and the new ones, [B, A, T, KVH, G, S or U] (qg [B, A, T, KVH,
  G, D]; k_old [B, KVH, S, D], k_new [B, A, U, KVH, D]), each an explicit tree of adds over
  the head dimension: IEEE operations, so the same in any shape."""
  qg = qg[..., None].astype(jnp.float32)                              # [B, A, T, KVH, G, D, 1]
  # keys head-dimension first, so that each level of the tree adds whole rows of keys
  ko = k_old.swapaxes(2, 3)[:, None, None, :, None].astype(jnp.float32)  # [B, 1, 1, KVH, 1, D, S]
  kn = k_new.transpose(0, 1, 3, 4, 2)[:, :, None, :, None].astype(jnp.float32)  # [B,A,1,KVH,1,D,U]
  return tree_sum(qg * ko, -2), tree_sum(qg * kn, -2)


def _mxu_scores(qg, k_old, k_new):
  """_tree_scores as products on a TPU's matrix unit: a dot over the head dimension (at most the
  unit's 128 in one pass) sums each entry's products in the array's fixed order, the same for
  every row and key (an assumption about the hardware that a TPU has to confirm; the elementwise
  tree was written to HBM level by level: 29 of 34 GB in a v5e chain iteration at batch 1)."""
  exact = jax.lax.Precision.HIGHEST if qg.dtype == jnp.float32 else None  # bf16 products fit f32
  dot = functools.partial(jnp.einsum, precision=exact, preferred_element_type=jnp.float32)
  return (dot("batkgd,bksd->batkgs", qg, k_old.astype(qg.dtype)),
          dot("batkgd,baukd->batkgu", qg, k_new.astype(qg.dtype)))


def _materialized(*xs):
  """xs as computed buffers. XLA:CPU fuses the producers of the attention's small operands (the
  new tokens' projections, norm and rope; the softmax weights) into the
  elementwise work over every key and recomputes them per term: the embedded default's
  invariant forward over 200 cached tokens took 45-49 ms, 32-36 ms with these buffers (the
  default mode's: 24-27). The operands of a conditional on a run-time predicate are computed
  once (an optimization barrier is removed before fusion on CPU). Other platforms take xs as
  they are."""
  def keep(*xs):   # the branches differ (identical ones are merged): NaN past a non-finite x
    first = next(x for x in xs if x.size)
    return jax.lax.cond(jnp.isfinite(first.reshape(-1)[0]), lambda *v: v,
                        lambda *v: tuple(map(_spoilt, v)), *xs)
  return jax.lax.platform_dependent(*xs, cpu=keep, default=lambda *v: v)


def _spoilt(x):
  return jnp.full_like(x, jnp.nan if jnp.issubdtype(x.dtype, jnp.inexact) else 0)
