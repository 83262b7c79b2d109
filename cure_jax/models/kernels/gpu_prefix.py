"""A prompt chunk's attention on NVIDIA GPUs as one Pallas (Triton) flash-attention kernel.

prefix.attend's XLA form writes every [T, T] block of scores to HBM and reads it back (Qwen3-8B,
T = 2048: about 2.9 GB a layer for each block of the cache, on an H100 compiled by
experiments.aot). Here a program holds one block of query rows of one head and streams the row's
filled cache slots, then the chunk's own keys up to its diagonal, through on-chip memory with an
online softmax, so HBM sees the queries, the keys and values read, and the output.

jax's own Triton flash attention (jax.experimental.pallas.ops.gpu.attention.mha) aligns its
causal mask at slot 0 of one key array; a chunk sits after a cache prefix whose length is a
loop variable, and its keys are in two arrays (the cache, the chunk), so this kernel is ours.
It has no gradient and is tested on CPU in Pallas interpret mode against prefix.attend's XLA
form (tests/test_attention_kernels.py).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.sharding import PartitionSpec as P

from cure_jax.models.axes import DATA, MODEL
from cure_jax.models.kernels import blocks

_NEG = float(jnp.finfo(jnp.float32).min)
_ROWS = 64   # query rows per program
_KEYS = 64   # keys per step of a program's loops


def tiles(s: int, t: int, head_dim: int) -> bool:
  """Whether the kernel takes a cache of S slots and chunks of T tokens: whole blocks of rows
  and keys; Triton's blocks are powers of two, so head_dim must be, and at least 16."""
  return (s % _KEYS == 0 and t % _ROWS == 0 and t % _KEYS == 0 and head_dim >= 16
          and head_dim & (head_dim - 1) == 0)


def _kernel(len_ref, q_ref, k_ref, v_ref, kn_ref, vn_ref, o_ref, *, scale: float, precision):
  """One (batch row, query head, block of rows): q [R, D]; the cache k/v [S, D] (its first
  `length` slots are visible); the chunk's kn/vn [T, D] (causal)."""
  i = pl.program_id(2)
  q = q_ref[...]
  length = len_ref[...]

  def update(carry, k, v, visible):            # k, v [N, D]; visible [R, N]
    acc, top, total = carry
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), precision=precision,
                            preferred_element_type=jnp.float32) * scale          # [R, N]
    s = jnp.where(visible, s, _NEG)
    new_top = jnp.maximum(top, s.max(axis=-1))
    p = jnp.where(visible, jnp.exp(s - new_top[:, None]), 0.0)
    alpha = jnp.exp(top - new_top)
    acc = alpha[:, None] * acc + jax.lax.dot_general(
        p.astype(v.dtype), v, (((1,), (0,)), ((), ())), precision=precision,
        preferred_element_type=jnp.float32)
    return acc, new_top, alpha * total + p.sum(axis=-1)

  def cache_step(j, carry):
    keys = pl.ds(j * _KEYS, _KEYS)
    slot = j * _KEYS + jnp.arange(_KEYS)
    visible = jnp.broadcast_to((slot < length)[None, :], (q.shape[0], _KEYS))
    return update(carry, k_ref[keys, :], v_ref[keys, :], visible)

  def chunk_step(j, carry):
    keys = pl.ds(j * _KEYS, _KEYS)
    rows = i * _ROWS + jnp.arange(_ROWS)
    cols = j * _KEYS + jnp.arange(_KEYS)
    return update(carry, kn_ref[keys, :], vn_ref[keys, :], rows[:, None] >= cols[None, :])

  rows, d = q.shape
  carry = (jnp.zeros((rows, d), jnp.float32), jnp.full((rows,), _NEG, jnp.float32),
           jnp.zeros((rows,), jnp.float32))
  carry = jax.lax.fori_loop(0, pl.cdiv(length, _KEYS), cache_step, carry)
  carry = jax.lax.fori_loop(0, ((i + 1) * _ROWS + _KEYS - 1) // _KEYS, chunk_step, carry)
  acc, _, total = carry
  o_ref[...] = (acc / jnp.where(total > 0, total, 1.0)[:, None]).astype(o_ref.dtype)


def kernel_call(lengths, q, k, v, k_new, v_new, *, interpret: bool = False):
  """lengths [B] int32; q [B, T, H, D]; k/v [B, KVH, S, D]; k_new/v_new [B, T, KVH, D]
  -> [B, T, H, D]."""
  b, t, h, d = q.shape
  kvh, s = k.shape[1], k.shape[2]
  g = h // kvh
  sq = pl.squeezed
  precision = jax.lax.Precision.HIGHEST if q.dtype == jnp.float32 else None  # no TF32 in f32
  return pl.pallas_call(
      functools.partial(_kernel, scale=1.0 / math.sqrt(d), precision=precision),
      out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype),
      grid=(b, h, t // _ROWS),
      in_specs=[
          pl.BlockSpec((sq,), lambda i, j, r: (i,)),
          pl.BlockSpec((sq, _ROWS, sq, d), lambda i, j, r: (i, r, j, 0)),
          pl.BlockSpec((sq, sq, s, d), lambda i, j, r: (i, j // g, 0, 0)),
          pl.BlockSpec((sq, sq, s, d), lambda i, j, r: (i, j // g, 0, 0)),
          pl.BlockSpec((sq, t, sq, d), lambda i, j, r: (i, 0, j // g, 0)),
          pl.BlockSpec((sq, t, sq, d), lambda i, j, r: (i, 0, j // g, 0)),
      ],
      out_specs=pl.BlockSpec((sq, _ROWS, sq, d), lambda i, j, r: (i, r, j, 0)),
      compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
      interpret=interpret,
  )(lengths, q, k, v, k_new, v_new)


def attend(q, k_cache, v_cache, k_new, v_new, lengths, *, interpret: bool = False):
  """prefix.attend's contract through the kernel, per shard of the mesh (batch over `data`,
  heads over `model`, as the caches are laid out). The chunk's padding rows (past a prompt's
  end) see the chunk causally and are discarded by the caller."""
  rows = P(DATA, None, MODEL)                                   # q, k_new, v_new, the output
  call = blocks.per_shard(functools.partial(kernel_call, interpret=interpret),
                          (blocks.BATCH, rows, blocks.HEADS, blocks.HEADS, rows, rows), rows)
  return call(lengths, q, k_cache, v_cache, k_new, v_new)
