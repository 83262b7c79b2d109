"""numerics=invariant's attention on TPUs: one Pallas TPU kernel per layer whose sums are exact,
as gpu_exact_attention's is on GPUs.

numerics.attend's XLA form, compiled for a v5e at batch 8, copies each layer's cache slices into
on-chip memory and back around its exact sums (96 copies of a layer's cache in an ar iteration:
1.4-1.5x the default mode's bytes). Here a program per (batch row, KV head, block of query rows)
streams the cache through VMEM in blocks of _KEYS slots, twice (a grid axis of two phases):
- phase 0 takes each row's largest visible score, a maximum: exact in any order;
- phase 1 takes the weights p = exp(s - max) and the weighted values p v, cuts every term to its
  grid and adds the integers exactly (exact_sums), so the sum is one integer whatever the order
  of the keys or their split between cache and new tokens.
After the cache's blocks come the new tokens', in blocks of the same _KEYS (padded): a (query,
key) score is an entry of a product of the same shapes wherever the key lies. Scores are taken
keys-major, k q^T [_KEYS, rows], so that a row's weights are a column that broadcasts across the
values' lanes and the sums over keys run down the sublanes. That the matrix unit gives an entry
the same bits wherever it lies in a product is the assumption numerics' TPU forms already make; a
TPU has to confirm it. Blocks of the cache past a batch row's last visible slot are neither
fetched nor computed.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.sharding import PartitionSpec as P

from cure_jax.models.axes import MODEL
from cure_jax.models.kernels import blocks
from cure_jax.models.kernels.exact_sums import GRID, add, halves, value

_NEG = float(jnp.finfo(jnp.float32).min)
_KEYS = 128   # keys per grid step (lanes of the scores' rows; at most 2^8 terms per block sum)
_ROWS = 16    # query rows per program at most: a step unrolls groups x rows weighted sums
_SUBLANES = 8  # rows of a block at least (the scores' lanes: Mosaic's dot takes no fewer)


def tiles(s: int) -> bool:
  """Whether the kernel takes a cache of S slots: whole blocks of _KEYS, at least one."""
  return s > 0 and s % _KEYS == 0


def _kernel(last_ref, scale_ref, q_ref, k_ref, v_ref, mo_ref, kn_ref, vn_ref, mn_ref, o_ref,
            top_sc, total_sc, acc_sc, *, score_scale: float, cache_blocks: int, live: int,
            precision):
  """One (batch row, KV head, row block); its grid steps are (phase, key block), the cache's
  blocks first, then the new tokens'. q [G, R, D]; k/v [_KEYS, D]; mo [_KEYS, R] int8 (keys
  first); kn/vn [N, D] and mn [N, R] (N whole blocks); scale [1, D] = 2^(44 - e) of the
  values' grid; rows past `live` are padding, neither summed nor stored. Scratch: top [G, 1, R]
  f32; total [3, G, 1, R] and acc [3, G, R, D] int32 limbs."""
  i, phase, j = pl.program_id(0), pl.program_id(3), pl.program_id(4)
  groups = q_ref.shape[0]

  @pl.when((phase == 0) & (j == 0))
  def _init():
    top_sc[...] = jnp.full(top_sc.shape, _NEG, jnp.float32)
    total_sc[...] = jnp.zeros(total_sc.shape, jnp.int32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.int32)

  def scores(g, k, seen):                                                # [KEYS, R]
    s = jax.lax.dot_general(k, q_ref[g], (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * score_scale
    return jnp.where(seen, s, _NEG)

  def largest(k, v, seen):
    del v
    for g in range(groups):
      top_sc[g] = jnp.maximum(top_sc[g], scores(g, k, seen).max(axis=0, keepdims=True))

  def accumulate(ref, at, high, low):                   # limbs ref[:, *at] += high 2^22 + low
    limbs = add(tuple(ref[(l,) + at] for l in range(3)), high.sum(axis=0, keepdims=True),
                low.sum(axis=0, keepdims=True))
    for l, x in enumerate(limbs):
      ref[(l,) + at] = x

  def sums(k, v, seen):
    values = v.astype(jnp.float32)
    scale = scale_ref[...]                                               # [1, D]
    for g in range(groups):
      p = jnp.where(seen, jnp.exp(scores(g, k, seen) - top_sc[g]), 0.0)  # [KEYS, R]
      accumulate(total_sc, (g,), *halves(p * 2.0 ** (GRID - 1)))         # p < 2^1
      for r in range(live):
        terms = p[:, r:r + 1] * values * scale                           # [KEYS, D]
        accumulate(acc_sc, (g, slice(r, r + 1)), *halves(terms))

  def visit(step):
    @pl.when(j < cache_blocks)
    def _cache():
      @pl.when(j <= last_ref[i])
      def _seen():
        step(k_ref[...], v_ref[...], mo_ref[...] != 0)

    @pl.when(j >= cache_blocks)
    def _new():
      keys = pl.ds(pl.multiple_of((j - cache_blocks) * _KEYS, _KEYS), _KEYS)
      step(kn_ref[keys, :], vn_ref[keys, :], mn_ref[keys, :] != 0)

  pl.when(phase == 0)(lambda: visit(largest))
  pl.when(phase == 1)(lambda: visit(sums))

  @pl.when((phase == 1) & (j == pl.num_programs(4) - 1))
  def _finish():
    unit = 1.0 / scale_ref[...]
    for g in range(groups):
      den = value(tuple(total_sc[l, g] for l in range(3)), 2.0 ** (1 - GRID))   # [1, R]
      den = jnp.where(den > 0, den, 1.0)
      for r in range(live):
        acc = value(tuple(acc_sc[l, g, r:r + 1] for l in range(3)), unit)      # [1, D]
        o_ref[g, r:r + 1] = (acc / den[:, r:r + 1]).astype(o_ref.dtype)


def kernel_call(scale, q, k_old, v_old, mask_old, k_new, v_new, mask_new, *, live: int,
                interpret: bool = False):
  """scale [KVH, 1, D] float32, 2^(44 - e) of the values' bound 2^e; q [B, KVH, G, R, D];
  k_old/v_old [B, KVH, S, D]; mask_old [B, RB, S, R / RB] int8 (keys first, per row block);
  k_new/v_new [B, KVH, N, D] (N whole blocks of _KEYS); mask_new [B, RB, N, R / RB] int8.
  live: each row block's rows that are not padding (the rest are left unwritten). Returns
  [B, KVH, G, R, D] in q's dtype."""
  b, kvh, g, r, d = q.shape
  s, n = k_old.shape[2], k_new.shape[2]
  row_blocks, rows = mask_old.shape[1], mask_old.shape[3]
  cache_blocks = s // _KEYS
  sq = pl.squeezed
  last = blocks.last_block(jnp.any(mask_old != 0, axis=(1, 3)), _KEYS)    # [B] int32

  # the cache block in use, past the last one seen that one repeated (not fetched again)
  def cache(i, h, rb, p, j, last):
    return i, h, jnp.minimum(j, last[i]), 0

  def values(i, h, rb, p, j, last):                 # phase 0 reads no values: one block stays
    return i, h, jnp.minimum(j * p, last[i]), 0

  def cache_mask(i, h, rb, p, j, last):
    return i, rb, jnp.minimum(j, last[i]), 0

  per_block = lambda i, h, rb, p, j, last: (i, h, 0, rb, 0)               # noqa: E731
  whole = lambda i, h, rb, p, j, last: (i, h, 0, 0)                       # noqa: E731
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None
  return pl.pallas_call(
      functools.partial(_kernel, score_scale=1.0 / math.sqrt(d), cache_blocks=cache_blocks,
                        live=live, precision=precision),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b, kvh, row_blocks, 2, cache_blocks + n // _KEYS),
          in_specs=[
              pl.BlockSpec((sq, 1, d), lambda i, h, rb, p, j, last: (h, 0, 0)),
              pl.BlockSpec((sq, sq, g, rows, d), per_block),
              pl.BlockSpec((sq, sq, _KEYS, d), cache),
              pl.BlockSpec((sq, sq, _KEYS, d), values),
              pl.BlockSpec((sq, sq, _KEYS, rows), cache_mask),
              pl.BlockSpec((sq, sq, n, d), whole),
              pl.BlockSpec((sq, sq, n, d), whole),
              pl.BlockSpec((sq, sq, n, rows), lambda i, h, rb, p, j, last: (i, rb, 0, 0)),
          ],
          out_specs=pl.BlockSpec((sq, sq, g, rows, d), per_block),
          scratch_shapes=[pltpu.VMEM((g, 1, rows), jnp.float32),
                          pltpu.VMEM((3, g, 1, rows), jnp.int32),
                          pltpu.VMEM((3, g, rows, d), jnp.int32)]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "parallel", "arbitrary", "arbitrary")),
      cost_estimate=pl.CostEstimate(
          flops=6 * b * kvh * g * r * (s + n) * d, transcendentals=b * kvh * g * r * (s + n),
          bytes_accessed=sum(x.size * x.dtype.itemsize for x in
                             (q, q, k_old, v_old, mask_old, k_new, v_new, mask_new))),
      interpret=interpret,
  )(last.astype(jnp.int32), scale, q, k_old, v_old, mask_old, k_new, v_new, mask_new)


def _keys_first(mask, row_blocks: int):
  """mask [B, R, K] -> [B, RB, K, R / RB] int8: each row block's mask, keys first."""
  b, r, k = mask.shape
  return mask.reshape(b, row_blocks, r // row_blocks, k).transpose(0, 1, 3, 2).astype(jnp.int8)


def attend(q, k_old, v_old, k_new, v_new, mask_old, mask_new, exponents, *,
           interpret: bool = False):
  """numerics.attend's contract (q [B, A, T, H, D] ... -> [B, A, T, H, D]; exponents [KVH * D])
  through the kernel, with the rows and shards of `blocks`."""
  a, t = q.shape[1:3]
  kvh = k_old.shape[1]
  kn, vn, mn = blocks.new_tokens(k_new, v_new, mask_new, t)              # [B, KVH, A*U, D]
  pad = max(-(-kn.shape[2] // _KEYS), 1) * _KEYS - kn.shape[2]          # whole blocks, one at least
  kn, vn = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (kn, vn))
  mn = jnp.pad(mn, ((0, 0), (0, 0), (0, pad)))                            # [B, A*T, N]
  mo = blocks.cache_mask(mask_old, a, t)                                  # [B, A*T, S]
  qr = blocks.query_rows(q, kvh)                                          # [B, KVH, G, R, D]
  r = qr.shape[3]
  rows = -(-r // _SUBLANES) * _SUBLANES if r <= _ROWS else _ROWS         # a block's rows
  extra = -r % rows                                                       # rows to whole blocks
  qr = jnp.pad(qr, ((0, 0),) * 3 + ((0, extra), (0, 0)))
  mo, mn = (_keys_first(jnp.pad(m, ((0, 0), (0, extra), (0, 0))), (r + extra) // rows)
            for m in (mo, mn))
  e = exponents.reshape(kvh, 1, -1)                                       # [KVH, 1, D]
  scale = jnp.ldexp(jnp.ones(e.shape, jnp.float32), GRID - e)
  heads, batch = blocks.HEADS, blocks.BATCH
  kernel = functools.partial(kernel_call, live=min(r, rows), interpret=interpret)
  specs = (P(MODEL), heads, heads, heads, batch, heads, heads, batch)
  call = blocks.per_shard(kernel, specs, heads)
  out = call(scale, qr, k_old, v_old, mo, kn, vn, mn)[:, :, :, :r]
  return blocks.block_rows(out, a, t)                                     # [B, A, T, H, D]
