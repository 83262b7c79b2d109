"""A grouped matmul for MoE experts on TPUs: jax's Pallas megablox kernel (`gmm`).

XLA makes `jax.lax.ragged_dot` a grouped-matmul custom call on TPUs, but nothing in the
compiled program says which experts it reads (costs/hlo_traffic charges it every expert).
megablox's gmm visits only the row tiles of non-empty groups (visit_empty_groups=False), so an
expert no row routes to is never copied in, and it runs under a named scope that says how many
tokens route through it (gpu_grouped.name), which the traffic counter reads. Rows come padded to
whole row tiles by the caller's gather (moe.grouped's `pad`).
"""

from __future__ import annotations

import jax
from jax.experimental.pallas.ops.tpu.megablox import gmm

from cure_jax.models.kernels import gpu_grouped

_TILE = 128   # contraction and output columns per tile


def row_tile(rows: int) -> int:
  """gmm's row tile for `rows` rows: 128, or fewer rows rounded up to 16 (bf16's sublanes)."""
  return 128 if rows >= 128 else -(-rows // 16) * 16


def grouped_matmul(rows, w, sizes, *, tokens: int = 1, top_k: int = 1, interpret: bool = False):
  """gpu_grouped.grouped_matmul's contract, except that rows [R, din] carry whole row tiles (R
  a multiple of row_tile(tokens x top_k)); rows past sum(sizes) come back unspecified."""
  with jax.named_scope(gpu_grouped.name(tokens, top_k)):
    return gmm(rows, w, sizes, preferred_element_type=rows.dtype,
               tiling=(row_tile(tokens * top_k), _TILE, _TILE), interpret=interpret)
