"""Attention over [cache ; new tokens] on GPUs as one Pallas (Triton) kernel per layer.

`layers.xla_attend` builds each layer's scores over the whole cache as XLA tensors. XLA's GPU
compiler writes them to HBM between the score, softmax and value fusions: for Qwen3-8B at batch 8
that was most of an iteration's activation traffic (WORKSPACE.md, "2026-12-03 — GPU work in part"). This kernel streams
the cache through on-chip memory in blocks of keys with an online softmax, as flash-decoding does,
so HBM sees the queries, the cache, the masks, the new tokens and small per-range partials only.

- *Split-K.* At batch 1 a (batch row, KV head) grid has 8 programs for Qwen3-8B, too few to draw
  an H100's bandwidth, so the cache is also split into ranges, a program each; the programs'
  partial (sum, max, denominator) are merged in XLA. A cache of one range (a short cache, or
  enough rows to fill the grid: a 256-node tree) is normalised in the kernel, which writes the
  attention itself in q's dtype.
- *The projections' layouts.* q is read as [rows, KV head, group, D] and the new keys and values
  as [tokens, KV head, D], as the projections write them, and the output is written the same
  way: no transposed copy on either side (at 256 rows, 0.45 GB an iteration of Qwen3-8B).
- *Only the filled part of the cache.* Each batch row's last visible slot bounds the loop, so a
  program past it reads nothing: a 300-token context reads 300 slots, not `max_len`.
- *Tree masks.* Each query row has its own mask over the new tokens (a tree's ancestors, a
  drafter block's own tokens), int8, and over the cache its own or, where the caller shares one
  (a verified tree, a drafter block), its batch row's; the last range's program attends the new
  ones.
- *No padded copies.* Rows come in blocks of 16 and new tokens in a power-of-two block of at
  least 16 (Triton's dot); the rows and tokens past the real ones are masked loads and stores, so
  a single query needs no padded copy of q, the new keys and values, or the masks (three to five
  small kernels per layer before).

The kernel has no gradient (training passes kernel=False) and is tested on CPU in Pallas
interpret mode against attention written out in numpy.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from cure_jax.models.kernels import blocks

_NEG = float(jnp.finfo(jnp.float32).min)
_KEYS = 64        # cache slots per step of a program's loop
_ROWS = 16        # query rows per program: Triton's dot takes at least 16
_MIN_SPLIT = 512  # cache slots per split at least: each split's partials cost HBM bytes
_PROGRAMS = 128   # enough programs to keep an H100's 132 SMs streaming


def _pow2(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def tiles(s: int, groups: int, head_dim: int) -> bool:
  """Whether the kernel takes a cache of S slots (whole blocks of keys, at least one) and these
  heads (heads_tile)."""
  return s > 0 and s % _KEYS == 0 and heads_tile(groups, head_dim)


def heads_tile(groups: int, head_dim: int) -> bool:
  """Whether a Triton attention kernel takes these heads: query heads per KV head and head_dim
  powers of two, head_dim at least 16 (its dot's smallest side)."""
  return _pow2(groups) and _pow2(head_dim) and head_dim >= 16


def num_splits(b: int, kvh: int, row_blocks: int, s: int) -> int:
  """Cache ranges per (batch row, KV head, row block): a power of two dividing the cache into
  ranges of at least _MIN_SPLIT slots, until the grid has _PROGRAMS programs."""
  n = 1
  while (b * kvh * row_blocks * n < _PROGRAMS and s % (2 * n * _KEYS) == 0
         and s // (2 * n) >= _MIN_SPLIT):
    n *= 2
  return n


def dot_block(n: int) -> int:
  """The power of two, at least 16 (Triton's smallest dot), that holds n rows."""
  return max(16, 1 << (n - 1).bit_length())


def mask_spec(mask, rows: int, keys: int, index):
  """The BlockSpec of a cache mask [B, R or 1, S] (blocks.triton_operands) for programs of
  `rows` query rows and `keys` slots, index(*program ids) -> (batch row, row block, key block);
  a mask the rows share is one row of every block."""
  shared = mask.shape[1] == 1

  def block(*ids):
    i, r, j = index(*ids)
    return i, 0 if shared else r, j

  return pl.BlockSpec((pl.squeezed, 1 if shared else rows, keys), block)


def cache_seen(mask_ref, keys, real):
  """[R or 1, N] bool: the cache mask's block at slots `keys`, rows past the real ones (real
  [R, 1]) not loaded; one row when the rows share it."""
  if mask_ref.shape[0] == 1:
    return mask_ref[:, keys] != 0
  return plgpu.load(mask_ref.at[:, keys], mask=real, other=0) != 0


def _kernel(hi_ref, q_ref, k_ref, v_ref, mask_ref, kn_ref, vn_ref, mn_ref, *out_refs,
            scale: float, groups: int, split: int, num_rows: int, num_new: int, precision):
  """One (batch row, KV head, row block, cache range): q [R, G, D], k/v [L, D], mask [R, L];
  the last range's program also attends the new tokens kn/vn [N, D] under their mask [R, N].
  Of the block's R rows and N new tokens, those past num_rows and num_new are not loaded, and
  their rows not stored. One range writes the attention itself, out [R, G, D]; several write
  their partials, acc [R, G, D] and max/sum [R, G]."""
  j = pl.program_id(3)
  steps = jnp.clip(pl.cdiv(hi_ref[...] - j * split, _KEYS), 0, split // _KEYS)
  rows, d = q_ref.shape[0], q_ref.shape[2]
  real = (pl.program_id(2) * rows + jnp.arange(rows) < num_rows)[:, None]  # [R, 1]
  new = jnp.arange(kn_ref.shape[0]) < num_new                              # [N]
  # (a traced head index: interpret mode takes it)
  heads = [jnp.int32(g) for g in range(groups)]
  qs = [plgpu.load(q_ref.at[:, g, :], mask=real, other=0) for g in heads]   # G x [R, D]

  def update(carry, k, v, visible):             # k, v [N, D]; visible [R, N]
    out = []
    for g, (acc, top, total) in enumerate(carry):
      s = jax.lax.dot_general(qs[g], k, (((1,), (1,)), ((), ())), precision=precision,
                              preferred_element_type=jnp.float32) * scale  # [R, N]
      s = jnp.where(visible, s, _NEG)
      new_top = jnp.maximum(top, s.max(axis=-1))
      p = jnp.where(visible, jnp.exp(s - new_top[:, None]), 0.0)
      alpha = jnp.exp(top - new_top)
      acc = alpha[:, None] * acc + jax.lax.dot_general(
          p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
          preferred_element_type=jnp.float32)
      out.append((acc, new_top, alpha * total + p.sum(axis=-1)))
    return tuple(out)

  def step(i, carry):
    keys = pl.ds(i * _KEYS, _KEYS)
    return update(carry, k_ref[keys, :], v_ref[keys, :], cache_seen(mask_ref, keys, real))

  def attend_new(carry):
    kn, vn = (plgpu.load(ref, mask=new[:, None], other=0) for ref in (kn_ref, vn_ref))
    seen = plgpu.load(mn_ref, mask=real & new[None, :], other=0) != 0
    return update(carry, kn, vn, seen)

  init = tuple((jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG, jnp.float32),
                jnp.zeros((rows,), jnp.float32)) for _ in range(groups))
  carry = jax.lax.fori_loop(0, steps, step, init)
  carry = jax.lax.cond(j == pl.num_programs(3) - 1, attend_new, lambda c: c, carry)
  for g, (acc, top, total) in zip(heads, carry):
    if len(out_refs) == 1:
      out = acc / jnp.where(total > 0, total, 1.0)[:, None]
      plgpu.store(out_refs[0].at[:, g, :], out.astype(out_refs[0].dtype), mask=real)
    else:
      acc_ref, max_ref, sum_ref = out_refs
      plgpu.store(acc_ref.at[:, g, :], acc, mask=real)
      plgpu.store(max_ref.at[:, g], top, mask=real[:, 0])
      plgpu.store(sum_ref.at[:, g], total, mask=real[:, 0])


def kernel_call(hi, q, k, v, mask, k_new, v_new, mask_new, *, interpret: bool = False):
  """hi [B] int32 (cache slots past it are masked for every row); q [B, R, KVH, G, D];
  k/v [B, KVH, S, D]; mask [B, R or 1, S] int8; k_new/v_new [B, U, KVH, D] and mask_new [B, R, U]
  int8. Returns the attention [B, R, KVH, G, D] in q's dtype: written by the kernel when the
  cache is one range, else merged here from the J ranges' unnormalised sums [B, J, R, KVH, G, D]
  (f32) and row maxima and denominators [B, J, R, KVH, G]."""
  b, r, kvh, g, d = q.shape
  s, u = k.shape[2], k_new.shape[1]
  n = dot_block(u)                 # the new tokens' block
  row_blocks = -(-r // _ROWS)
  splits = num_splits(b, kvh, row_blocks, s)
  split = s // splits
  sq = pl.squeezed
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # no TF32 in f32
  if splits == 1:
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    out_specs = [pl.BlockSpec((sq, _ROWS, sq, g, d), lambda i, h, r, j: (i, r, h, 0, 0))]
  else:
    part = (b, splits, r, kvh, g)
    out_shape = [jax.ShapeDtypeStruct(part + (d,), jnp.float32),
                 jax.ShapeDtypeStruct(part, jnp.float32), jax.ShapeDtypeStruct(part, jnp.float32)]
    out_specs = [pl.BlockSpec((sq, sq, _ROWS, sq, g, d), lambda i, h, r, j: (i, j, r, h, 0, 0)),
                 pl.BlockSpec((sq, sq, _ROWS, sq, g), lambda i, h, r, j: (i, j, r, h, 0)),
                 pl.BlockSpec((sq, sq, _ROWS, sq, g), lambda i, h, r, j: (i, j, r, h, 0))]
  out = pl.pallas_call(
      functools.partial(_kernel, scale=1.0 / math.sqrt(d), groups=g, split=split,
                        num_rows=r, num_new=u, precision=precision),
      out_shape=out_shape,
      grid=(b, kvh, row_blocks, splits),
      in_specs=[
          pl.BlockSpec((sq,), lambda i, h, r, j: (i,)),
          pl.BlockSpec((sq, _ROWS, sq, g, d), lambda i, h, r, j: (i, r, h, 0, 0)),
          pl.BlockSpec((sq, sq, split, d), lambda i, h, r, j: (i, h, j, 0)),
          pl.BlockSpec((sq, sq, split, d), lambda i, h, r, j: (i, h, j, 0)),
          mask_spec(mask, _ROWS, split, lambda i, h, r, j: (i, r, j)),
          pl.BlockSpec((sq, n, sq, d), lambda i, h, r, j: (i, 0, h, 0)),
          pl.BlockSpec((sq, n, sq, d), lambda i, h, r, j: (i, 0, h, 0)),
          pl.BlockSpec((sq, _ROWS, n), lambda i, h, r, j: (i, r, 0)),
      ],
      out_specs=out_specs,
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
  )(hi, q, k, v, mask, k_new, v_new, mask_new)
  if splits == 1:
    return out[0]
  acc, top, total = out
  # merge the J ranges by their maxima
  w = jnp.exp(top - top.max(axis=1, keepdims=True))                      # [B, J, R, KVH, G]
  den = (w * total).sum(axis=1)
  merged = (w[..., None] * acc).sum(axis=1) / jnp.where(den > 0, den, 1.0)[..., None]
  return merged.astype(q.dtype)                                          # [B, R, KVH, G, D]


def attend(q, k_old, v_old, k_new, v_new, mask_old, mask_new, *, interpret: bool = False):
  """`layers.attend`'s contract (q [B, A, T, H, D] ... -> [B, A, T, H, D]) through the kernel,
  with the rows and shards of `blocks`."""
  hi, qr, mask, kn, vn, mn = blocks.triton_operands(q, mask_old, k_new, v_new, mask_new)
  rows, heads, batch = blocks.ROW_HEADS, blocks.HEADS, blocks.BATCH
  call = blocks.per_shard(functools.partial(kernel_call, interpret=interpret),
                          (batch, rows, heads, heads, batch, rows, rows, batch), rows)
  return call(hi, qr, k_old, v_old, mask, kn, vn, mn).reshape(q.shape)   # [B, A, T, H, D]
