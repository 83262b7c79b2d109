"""numerics=invariant's attention on GPUs: one Pallas (Triton) kernel per layer whose sums are
exact, so a query's output is the same bits whatever rows, tree nodes or split between cache and
new tokens come with it.

numerics.attend in XLA builds every score and weighted value over the whole static cache as HBM
tensors (Qwen3-8B chain verification at batch 8 on an H100: about 10 GB an iteration). Here a
program per (batch row, KV head, 16 query rows) keeps them on chip:
- pass 1 walks the visible keys (cache slots up to the last visible one, then the new tokens) in
  blocks of _KEYS and takes each row's largest score: a maximum, exact in any order;
- pass 2 walks them again (the keys are read twice, the values once), takes p = exp(s - max)
  and the weighted values p v, cuts each term to its grid as numerics.attend does (t = x 2^(44-e)
  toward zero: the same integers) and adds the integers in int32, exactly: a term is split into
  its high and low 22 bits, a block's halves summed, and the running sum kept as three 22-bit
  limbs with carries, so it is one integer whatever the order of the keys.
Scores are the dot of a 16-row block of queries with a block of _KEYS keys, the same shapes for
cache and new keys, so a (query, key) pair's score is one tile product's entry wherever the
pair lies (the fixed-tile assumption gpu_rows rests on). No split of the cache: a split's
maximum would have to reach the others before their sums, so a batch-1 layer runs as 8 programs
(Qwen3-8B), which the counts do not price and a GPU has to time.

Tested on CPU in Pallas interpret mode: against float64 attention, and bitwise across splits,
rows and tree positions (tests/test_numerics.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from cure_jax.models.kernels import blocks, gpu_attention
from cure_jax.models.kernels.exact_sums import GRID, add, halves, value

_NEG = float(jnp.finfo(jnp.float32).min)
_KEYS = 16   # keys per step: a step's [rows, keys, head_dim] weighted values sit in registers
_ROWS = 16   # query rows per program: Triton's dot takes at least 16


def tiles(s: int, groups: int, head_dim: int) -> bool:
  """Whether the kernel takes a cache of S slots (whole blocks of keys) and these heads
  (gpu_attention.heads_tile)."""
  return s > 0 and s % _KEYS == 0 and gpu_attention.heads_tile(groups, head_dim)


def _kernel(hi_ref, scale_ref, q_ref, k_ref, v_ref, mask_ref, kn_ref, vn_ref, mn_ref, out_ref, *,
            score_scale: float, groups: int, num_rows: int, num_new: int, precision):
  """One (batch row, KV head, row block): q [R, G, D], k/v [S, D], mask [R, S]; new tokens
  kn/vn [N, D] (N: num_new rounded up to _KEYS) under mn [R, N]; scale [D] = 2^(44 - e) of the
  values' grid. Rows past num_rows and tokens past num_new are not loaded."""
  rows, d = q_ref.shape[0], q_ref.shape[2]
  real = (pl.program_id(2) * rows + jnp.arange(rows) < num_rows)[:, None]      # [R, 1]
  heads = [jnp.int32(g) for g in range(groups)]   # (a traced index: interpret mode takes it)
  qs = [plgpu.load(q_ref.at[:, g, :], mask=real, other=0) for g in heads]      # G x [R, D]
  scale = scale_ref[...]                                                       # [D]
  cache_steps = pl.cdiv(hi_ref[...], _KEYS)
  new_steps = pl.cdiv(num_new, _KEYS)

  def cached(i):
    keys = pl.ds(i * _KEYS, _KEYS)
    seen = gpu_attention.cache_seen(mask_ref, keys, real)
    return k_ref[keys, :], v_ref[keys, :], seen

  def new(i):
    keys = pl.ds(i * _KEYS, _KEYS)
    ok = i * _KEYS + jnp.arange(_KEYS) < num_new
    k, v = (plgpu.load(ref.at[keys, :], mask=ok[:, None], other=0) for ref in (kn_ref, vn_ref))
    seen = plgpu.load(mn_ref.at[:, keys], mask=real & ok[None, :], other=0) != 0
    return k, v, seen

  def scores(q, k, seen):                                                      # [R, KEYS]
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * score_scale
    return jnp.where(seen, s, _NEG)

  def largest(block):
    def step(i, tops):
      k, _, seen = block(i)
      return tuple(jnp.maximum(top, scores(q, k, seen).max(axis=-1)) for q, top in zip(qs, tops))
    return step

  def sums(block):
    def step(i, carry):
      k, v, seen = block(i)
      out = []
      for q, top, (total, acc) in zip(qs, tops, carry):
        p = jnp.where(seen, jnp.exp(scores(q, k, seen) - top[:, None]), 0.0)     # [R, KEYS]
        high, low = halves(p * 2.0 ** (GRID - 1))                               # p < 2^1
        total = add(total, high.sum(axis=1), low.sum(axis=1))
        terms = p[:, :, None] * v.astype(jnp.float32)[None] * scale              # [R, KEYS, D]
        high, low = halves(terms)
        out.append((total, add(acc, high.sum(axis=1), low.sum(axis=1))))
      return tuple(out)
    return step

  tops = tuple(jnp.full((rows,), _NEG, jnp.float32) for _ in qs)
  tops = jax.lax.fori_loop(0, cache_steps, largest(cached), tops)
  tops = jax.lax.fori_loop(0, new_steps, largest(new), tops)
  zero = lambda *shape: tuple(jnp.zeros(shape, jnp.int32) for _ in range(3))   # noqa: E731
  carry = tuple((zero(rows), zero(rows, d)) for _ in qs)
  carry = jax.lax.fori_loop(0, cache_steps, sums(cached), carry)
  carry = jax.lax.fori_loop(0, new_steps, sums(new), carry)
  for g, (total, acc) in zip(heads, carry):
    den = value(total, 2.0 ** (1 - GRID))
    out = value(acc, 1.0 / scale) / jnp.where(den > 0, den, 1.0)[:, None]
    plgpu.store(out_ref.at[:, g, :], out.astype(out_ref.dtype), mask=real)


def kernel_call(hi, scale, q, k, v, mask, k_new, v_new, mask_new, *, interpret: bool = False):
  """hi [B] int32 (slots past it are masked for every row); scale [KVH, D] float32, 2^(44 - e)
  of the values' bound 2^e; q [B, R, KVH, G, D]; k/v [B, KVH, S, D]; mask [B, R or 1, S] int8;
  k_new/v_new [B, U, KVH, D] and mask_new [B, R, U] int8. Returns [B, R, KVH, G, D] in q's
  dtype."""
  b, r, kvh, g, d = q.shape
  s, u = k.shape[2], k_new.shape[1]
  n = max(_KEYS, -(-u // _KEYS) * _KEYS)       # the new tokens' blocks, loaded under a mask
  sq = pl.squeezed
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None   # no TF32 in f32
  return pl.pallas_call(
      functools.partial(_kernel, score_scale=1.0 / math.sqrt(d), groups=g, num_rows=r,
                        num_new=u, precision=precision),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(b, kvh, -(-r // _ROWS)),
      in_specs=[
          pl.BlockSpec((sq,), lambda i, h, j: (i,)),
          pl.BlockSpec((sq, d), lambda i, h, j: (h, 0)),
          pl.BlockSpec((sq, _ROWS, sq, g, d), lambda i, h, j: (i, j, h, 0, 0)),
          pl.BlockSpec((sq, sq, s, d), lambda i, h, j: (i, h, 0, 0)),
          pl.BlockSpec((sq, sq, s, d), lambda i, h, j: (i, h, 0, 0)),
          gpu_attention.mask_spec(mask, _ROWS, s, lambda i, h, j: (i, j, 0)),
          pl.BlockSpec((sq, n, sq, d), lambda i, h, j: (i, 0, h, 0)),
          pl.BlockSpec((sq, n, sq, d), lambda i, h, j: (i, 0, h, 0)),
          pl.BlockSpec((sq, _ROWS, n), lambda i, h, j: (i, j, 0)),
      ],
      out_specs=pl.BlockSpec((sq, _ROWS, sq, g, d), lambda i, h, j: (i, j, h, 0, 0)),
      compiler_params=plgpu.CompilerParams(num_warps=8, num_stages=2),
      interpret=interpret,
  )(hi, scale, q, k, v, mask, k_new, v_new, mask_new)


def attend(q, k_old, v_old, k_new, v_new, mask_old, mask_new, exponents, *,
           interpret: bool = False):
  """numerics.attend's contract (q [B, A, T, H, D] ... -> [B, A, T, H, D]; exponents [KVH * D])
  through the kernel, with the rows of `blocks`."""
  hi, qr, mask, kn, vn, mn = blocks.triton_operands(q, mask_old, k_new, v_new, mask_new)
  e = exponents.reshape(k_old.shape[1], -1)                               # [KVH, D]
  scale = jnp.ldexp(jnp.ones(e.shape, jnp.float32), GRID - e)
  out = kernel_call(hi, scale, qr, k_old, v_old, mask, kn, vn, mn, interpret=interpret)
  return out.reshape(q.shape)                                             # [B, A, T, H, D]
