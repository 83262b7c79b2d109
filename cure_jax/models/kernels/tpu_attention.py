"""Attention over [cache ; new tokens] as one TPU kernel: the scores never leave the chip.

`layers.attend` builds the scores as XLA tensors. XLA's TPU compiler keeps them in on-chip memory
on v5e, but on v5p (and on v6e at batch 8) it writes each layer's f32 scores to HBM beside their
row maximum and reads them back for the sum and the value product: three times the scores' size
per layer, 0.9 GB an iteration for CURE's verification at batch 1 (WORKSPACE.md, "2026-12-01 — CURE's
re-draft attention no longer goes through HBM").
This Pallas kernel streams the cache through VMEM in blocks of keys with an online softmax (as
flash attention does), so HBM sees the queries, the cache, the masks and the output only.

Layout: `blocks` (the A independent blocks' rows share a kernel instance, so the cache is read
once for all of them; their new tokens are laid side by side with a block-diagonal mask).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from cure_jax.models.kernels import blocks

_NEG = float(jnp.finfo(jnp.float32).min)
_LANES = 128
_SUBLANES = 8


def tiles(s: int) -> bool:
  """Whether the kernel takes a cache of S slots: whole blocks of 128 (lanes), at least one."""
  return s > 0 and s % _LANES == 0


def key_block(s: int) -> int:
  """Cache slots per grid step: the largest of 512/256/128 dividing S."""
  return next(c for c in (512, 256, 128) if s % c == 0)


def _kernel(last_ref, q_ref, k_ref, v_ref, mo_ref, kn_ref, vn_ref, mn_ref, o_ref, m_sc, l_sc,
            acc_sc, *, scale: float, groups: int):
  """One (batch row, KV head) pair, one block of cache slots; the new tokens at the last block.
  Blocks past last_ref[row] (the last one the row's queries see) are neither fetched (their
  index map repeats that block, which the pipeline does not fetch again) nor computed."""
  j = pl.program_id(2)

  @pl.when(j == 0)
  def _init():
    m_sc[...] = jnp.full(m_sc.shape, _NEG, jnp.float32)
    l_sc[...] = jnp.zeros(l_sc.shape, jnp.float32)
    acc_sc[...] = jnp.zeros(acc_sc.shape, jnp.float32)

  def update(k, v, visible):                  # k, v [N, D]; visible [R, N]
    for g in range(groups):
      s = jax.lax.dot_general(q_ref[g], k, (((1,), (1,)), ((), ())),
                              preferred_element_type=jnp.float32) * scale      # [R, N]
      s = jnp.where(visible, s, _NEG)
      m_prev = m_sc[g]                                                          # [R, 1]
      m_new = jnp.maximum(m_prev, s.max(axis=-1, keepdims=True))
      p = jnp.where(visible, jnp.exp(s - m_new), 0.0)
      alpha = jnp.exp(m_prev - m_new)
      l_sc[g] = alpha * l_sc[g] + p.sum(axis=-1, keepdims=True)
      acc_sc[g] = alpha * acc_sc[g] + jax.lax.dot_general(
          p.astype(v.dtype), v, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32)
      m_sc[g] = m_new

  @pl.when(j <= last_ref[pl.program_id(0)])
  def _cache_block():
    update(k_ref[...], v_ref[...], mo_ref[...] != 0)

  @pl.when(j == pl.num_programs(2) - 1)
  def _finish():
    update(kn_ref[...], vn_ref[...], mn_ref[...] != 0)
    for g in range(groups):
      l = l_sc[g]
      o_ref[g] = (acc_sc[g] / jnp.where(l > 0, l, 1.0)).astype(o_ref.dtype)


def kernel_call(q, k_old, v_old, mask_old, k_new, v_new, mask_new, *, interpret: bool = False):
  """q [B, KVH, G, R, D]; k_old/v_old [B, KVH, S, D]; mask_old [B, R, S] int8;
  k_new/v_new [B, KVH, N, D]; mask_new [B, R, N] int8. Returns [B, KVH, G, R, D] in q's dtype.
  """
  b, kvh, g, r, d = q.shape
  s, n = k_old.shape[2], k_new.shape[2]
  sb = key_block(s)
  sq = pl.squeezed
  last = blocks.last_block(jnp.any(mask_old != 0, axis=1), sb)            # [B] int32
  cache = lambda i, h, j, last: (i, h, jnp.minimum(j, last[i]), 0)        # noqa: E731
  whole = lambda i, h, j, last: (i, h, 0, 0)                              # noqa: E731
  return pl.pallas_call(
      functools.partial(_kernel, scale=1.0 / math.sqrt(d), groups=g),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid_spec=pltpu.PrefetchScalarGridSpec(
          num_scalar_prefetch=1,
          grid=(b, kvh, s // sb),
          in_specs=[
              pl.BlockSpec((sq, sq, g, r, d), lambda i, h, j, last: (i, h, 0, 0, 0)),
              pl.BlockSpec((sq, sq, sb, d), cache),
              pl.BlockSpec((sq, sq, sb, d), cache),
              pl.BlockSpec((sq, r, sb), lambda i, h, j, last: (i, 0, jnp.minimum(j, last[i]))),
              pl.BlockSpec((sq, sq, n, d), whole),
              pl.BlockSpec((sq, sq, n, d), whole),
              pl.BlockSpec((sq, r, n), lambda i, h, j, last: (i, 0, 0)),
          ],
          out_specs=pl.BlockSpec((sq, sq, g, r, d), lambda i, h, j, last: (i, h, 0, 0, 0)),
          scratch_shapes=[pltpu.VMEM((g, r, 1), jnp.float32), pltpu.VMEM((g, r, 1), jnp.float32),
                          pltpu.VMEM((g, r, d), jnp.float32)]),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      # what XLA's cost analysis (and experiments.aot's projection) counts for the kernel
      cost_estimate=pl.CostEstimate(
          flops=4 * b * kvh * g * r * (s + n) * d, transcendentals=b * kvh * g * r * (s + n),
          bytes_accessed=sum(x.size * x.dtype.itemsize
                             for x in (q, q, k_old, v_old, mask_old, k_new, v_new, mask_new))),
      interpret=interpret,
  )(last.astype(jnp.int32), q, k_old, v_old, mask_old, k_new, v_new, mask_new)


def attend(q, k_old, v_old, k_new, v_new, mask_old, mask_new, *, interpret: bool = False):
  """`layers.attend`'s contract (q [B, A, T, H, D] ... -> [B, A, T, H, D]) through the kernel,
  with the rows and shards of `blocks`."""
  a, t = q.shape[1:3]
  kn, vn, mn = blocks.new_tokens(k_new, v_new, mask_new, t)
  pad = -kn.shape[2] % _SUBLANES    # whole sublanes of new tokens (Mosaic cannot broadcast 1)
  kn, vn = (jnp.pad(x, ((0, 0), (0, 0), (0, pad), (0, 0))) for x in (kn, vn))  # [B, KVH, N, D]
  mn = jnp.pad(mn, ((0, 0), (0, 0), (0, pad))).astype(jnp.int8)            # [B, A*T, N]
  mo = blocks.cache_mask(mask_old, a, t).astype(jnp.int8)                  # [B, A*T, S]
  heads, batch = blocks.HEADS, blocks.BATCH
  call = blocks.per_shard(functools.partial(kernel_call, interpret=interpret),
                          (heads, heads, heads, batch, heads, heads, batch), heads)
  out = call(blocks.query_rows(q, k_old.shape[1]), k_old, v_old, mo, kn, vn, mn)
  return blocks.block_rows(out, a, t)                                      # [B, A, T, H, D]
