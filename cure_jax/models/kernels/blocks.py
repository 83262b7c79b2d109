"""How `layers.attend`'s contract becomes a kernel's rows, for the TPU and GPU kernels alike.

A KV head's G query heads and all A blocks' T rows share a kernel program (rows = A x T), so the
cache is read once for all of them; the blocks' new tokens are laid side by side, and a
block-diagonal mask keeps each block's rows on its own. Under a mesh a kernel runs per shard:
batch rows over `data`, KV heads over `model`, as the caches are laid out (sharding.CACHE_SPEC),
so no collective is added.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from cure_jax.models.axes import DATA, MODEL

HEADS, BATCH = P(DATA, MODEL), P(DATA)     # a kernel operand split by KV heads, or by batch only
ROW_HEADS = P(DATA, None, MODEL)           # [B, rows, KVH, ...]: split by KV heads behind the rows


def query_rows(q, kvh: int):
  """q [B, A, T, H, D] -> [B, KVH, G, A*T, D]."""
  b, a, t, h, d = q.shape
  q = q.reshape(b, a, t, kvh, h // kvh, d).transpose(0, 3, 4, 1, 2, 5)    # [B, KVH, G, A, T, D]
  return q.reshape(b, kvh, h // kvh, a * t, d)


def block_rows(out, a: int, t: int):
  """query_rows' inverse: [B, KVH, G, A*T, D] -> [B, A, T, H, D]."""
  b, kvh, g, _, d = out.shape
  out = out.reshape(b, kvh, g, a, t, d).transpose(0, 3, 4, 1, 2, 5)
  return out.reshape(b, a, t, kvh * g, d)


def cache_mask(mask_old, a: int, t: int):
  """mask_old [B, A or 1, T, S] (callers may share one over A) -> [B, A*T, S]."""
  b, s = mask_old.shape[0], mask_old.shape[-1]
  return jnp.broadcast_to(mask_old, (b, a, t, s)).reshape(b, a * t, s)


def last_block(visible, block: int):
  """visible [B, S] (the cache slots any of a batch row's queries sees) -> [B] int32 the last
  block of `block` slots holding one (0 when none does): a TPU kernel's grid stops there."""
  seen = jnp.max(jnp.where(visible, jnp.arange(visible.shape[-1]) + 1, 0), axis=-1)
  return jnp.maximum(seen - 1, 0) // block


def new_tokens(k_new, v_new, mask_new, t: int):
  """k_new/v_new [B, A, U, KVH, D] -> [B, KVH, A*U, D] side by side; mask_new [B, A or 1, T, U]
  -> [B, A*T, A*U], block-diagonal."""
  b, a, u, kvh, d = k_new.shape
  kn, vn = (x.transpose(0, 3, 1, 2, 4).reshape(b, kvh, a * u, d) for x in (k_new, v_new))
  return kn, vn, new_mask(mask_new, a, t, u)


def new_mask(mask_new, a: int, t: int, u: int):
  """mask_new [B, A or 1, T, U] -> [B, A*T, A*U]: block-diagonal, each block's rows see their
  own block's new tokens only."""
  b = mask_new.shape[0]
  own = jnp.eye(a, dtype=bool)[None, :, None, :, None]                     # [1, A, 1, A, 1]
  mn = jnp.broadcast_to(mask_new, (b, a, t, u))[:, :, :, None, :] & own    # [B, A, T, A, U]
  return mn.reshape(b, a * t, a * u)


def triton_operands(q, mask_old, k_new, v_new, mask_new):
  """The GPU (Triton) kernels' operands, in the layouts the projections write (so no transposed
  copy is made): hi [B] int32 (each batch row's last visible cache slot + 1, the end of its
  programs' loops), q as [B, A*T, KVH, G, D], the cache mask int8, [B, 1, S] when mask_old
  [B, 1, 1, S] is every row's (a verified tree's, a drafter block's: one row read, not A*T) and
  else [B, A*T, S], the new tokens [B, A*U, KVH, D] side by side and their block-diagonal mask
  [B, A*T, A*U] int8."""
  b, a, t, h, d = q.shape
  u, kvh = k_new.shape[2:4]
  shared = mask_old.shape[1:3] == (1, 1)
  mask = mask_old[:, 0] if shared else cache_mask(mask_old, a, t)        # [B, 1 or A*T, S]
  slot = jnp.arange(1, mask.shape[-1] + 1, dtype=jnp.int32)
  hi = jnp.max(jnp.where(mask, slot, 0), axis=(1, 2))                     # [B]
  kn, vn = (x.reshape(b, a * u, kvh, d) for x in (k_new, v_new))
  return (hi, q.reshape(b, a * t, kvh, h // kvh, d), mask.astype(jnp.int8), kn, vn,
          new_mask(mask_new, a, t, u).astype(jnp.int8))


def one_device() -> bool:
  """Whether the current trace runs on one device (no mesh, or a mesh of one): the kernels that
  have no per-shard form (gpu_layer, gpu_rows, gpu_exact_attention) take only that."""
  mesh = jax.sharding.get_abstract_mesh()
  return mesh.empty or mesh.size == 1


def per_shard(call, in_specs: tuple, out_specs):
  """`call` per shard of the current mesh (jax.set_mesh), or as it is without one."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return call
  return jax.shard_map(call, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
