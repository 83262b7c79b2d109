"""How each method proposes a candidate tree, and how its drafter catches up after a commit.

ar       no drafter: the tree is the root alone, the target emits one token.
chain    DFlash drafts K-1 tokens in one pass; the tree is that single path.
cure     chain plus repair paths at uncertainty focal points, each suffix re-drafted by DFlash.
ar_draft a small autoregressive Qwen3 drafts gamma tokens one at a time; the tree is that path.

Invariant shared by all: the target cache and the drafter state hold every committed token
except the anchor (the last one), which is the tree's root at position `lengths`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax import struct

from cure_jax import repair, sampling, tree as tree_lib
from cure_jax.cache import KVCache, take_tokens
from cure_jax.sampling import Sampling

METHODS = ("ar", "chain", "cure", "ar_draft")


@dataclasses.dataclass(frozen=True)
class Spec:
  """Everything static about a decoding run (one compile per distinct Spec)."""

  method: str
  max_new_tokens: int
  max_len: int
  stop_ids: tuple[int, ...] = ()
  block_size: int = 1                      # K: tree depth + 1 (chain/cure), gamma + 1 (ar_draft)
  mask_token_id: int = 0
  feature_layers: tuple[int, ...] = ()
  cure: repair.RepairConfig | None = None
  sampling: Sampling = Sampling()

  def __post_init__(self):
    if self.method not in METHODS:
      raise ValueError(f"method={self.method!r}; choose one of {METHODS}")

  @property
  def max_depth(self) -> int:
    return self.cure.max_depth if self.method == "cure" else self.block_size - 1

  @property
  def max_children(self) -> int:
    """Most children one tree node can have (siblings tested in turn when sampling)."""
    return 1 + self.cure.num_paths if self.method == "cure" else 1


@struct.dataclass
class Proposal:
  tree: tree_lib.Tree
  gate: repair.Gate | None = None
  block_margins: jax.Array | None = None  # [B, K-1] top-1 minus top-2 of the main draft
  q: jax.Array | None = None              # [B, V, N] distribution each node was drawn from
  deterministic: jax.Array | None = None  # [B, V] nodes placed by rank (one-hot q)


def depth_limit(spec: Spec, lengths, produced):
  """Deepest useful tree depth: no deeper than the tokens still owed or the cache allows."""
  owed = spec.max_new_tokens - produced
  room = spec.max_len - 1 - lengths
  return jnp.clip(jnp.minimum(jnp.minimum(owed, room), spec.max_depth), 0, None)


def choose(spec: Spec, key, logits):
  """Draft tokens from logits [..., V]: argmax, or a draw from the warped distribution q.

  Returns tokens [...] and q [..., V] (None when greedy)."""
  if spec.sampling.greedy:
    return jnp.argmax(logits, axis=-1).astype(jnp.int32), None
  q = sampling.warp(logits, spec.sampling)
  return sampling.draw(key, q), q


def _dflash_logits(target, drafter, dcache, spec: Spec, anchor, lengths, limit, known=None):
  """One DFlash pass; known [B, A, K-1] tokens at block positions 1.. (mask id = unknown).

  Returns float32 draft logits [B, A, K-1, V].
  """
  k = spec.block_size
  b = anchor.shape[0]
  if known is None:
    known = jnp.full((b, 1, k - 1), spec.mask_token_id, jnp.int32)
  blocks = jnp.concatenate([jnp.broadcast_to(anchor[:, None, None], known.shape[:2] + (1,)),
                            known], axis=-1)                                # [B, A, K]
  positions = lengths[:, None] + jnp.arange(k)[None]                       # [B, K]
  hidden = drafter(target.embed(blocks), positions, dcache, limit + 1)
  return drafter.draft_logits(hidden[:, :, 1:], target.logits)


def _node_table(tree, root_row, rows):
  """Per-node values [B, V, ...] from raw rows [B, N-1, ...] (branch 0, then paths)."""
  table = jnp.concatenate([root_row, rows], axis=1)
  idx = tree.source.reshape(tree.source.shape + (1,) * (table.ndim - 2))
  return jnp.take_along_axis(table, idx, axis=1)


def propose(target, drafter, dcache, spec: Spec, key, anchor, lengths, limit):
  """Builds this iteration's candidate tree; returns it and the drafter cache (ar_draft extends
  it while drafting)."""
  b = anchor.shape[0]
  if spec.method == "ar":
    empty = jnp.zeros((b, 0), jnp.int32)
    return Proposal(tree_lib.build(anchor, empty, limit, v_max=1)), dcache
  key_main, key_repair = jax.random.split(key)
  if spec.method == "ar_draft":
    draft, q_main, dcache = _autoregressive_draft(drafter, dcache, spec, key_main, anchor, lengths)
    return _chain(spec, anchor, draft, q_main, limit), dcache
  logits = _dflash_logits(target, drafter, dcache, spec, anchor, lengths, limit)[:, 0]
  draft, q_main = choose(spec, key_main, logits)                             # [B, K-1(, V)]
  if spec.method == "chain":
    return _chain(spec, anchor, draft, q_main, limit, logits), dcache
  return _repair_tree(target, drafter, dcache, spec, key_repair, anchor, lengths, limit, draft,
                      q_main, logits), dcache


def _chain(spec: Spec, anchor, draft, q_main, limit, logits=None) -> Proposal:
  t = tree_lib.build(anchor, draft, limit, v_max=spec.block_size)
  margins = None if logits is None else repair.margins(logits)
  if q_main is None:
    return Proposal(t, block_margins=margins)
  q = _node_table(t, jnp.zeros_like(q_main[:, :1]), q_main)
  return Proposal(t, block_margins=margins, q=q, deterministic=jnp.zeros(t.valid.shape, bool))


def _repair_tree(target, drafter, dcache, spec: Spec, key, anchor, lengths, limit, draft, q_main,
                 logits) -> Proposal:
  """Branch 0 plus repair paths: alternatives at the gate's UFPs, suffixes re-drafted by DFlash
  with the substituted token (and the shared prefix) filled into the block."""
  cfg = spec.cure
  gate, alternatives = repair.select(logits, draft, limit, cfg)
  depth, alt, valid = repair.repair_paths(gate, alternatives, cfg.num_paths)
  d = jnp.arange(1, spec.block_size)[None, None]                            # [1, 1, K-1]
  j = depth[..., None]
  known = jnp.where(d < j, draft[:, None], jnp.where(d == j, alt[..., None], spec.mask_token_id))
  b, r = depth.shape
  n_vocab = logits.shape[-1]
  empty_q = jnp.zeros((b, r, spec.block_size - 1, 0 if spec.sampling.greedy else n_vocab))

  def redraft():
    suffix, q_paths = choose(spec, key, _dflash_logits(target, drafter, dcache, spec, anchor,
                                                       lengths, limit, known))
    return jnp.where(d <= j, known, suffix), empty_q if q_paths is None else q_paths

  path_tokens, q_paths = jax.lax.cond(jnp.any(valid), redraft, lambda: (known, empty_q))
  t = tree_lib.build(anchor, draft, limit, v_max=cfg.v_max, keep_branch0=cfg.keep_branch0,
                     path_tokens=path_tokens, path_depth=depth, path_valid=valid)
  proposal = Proposal(t, gate=gate, block_margins=repair.margins(logits))
  if spec.sampling.greedy:
    return proposal
  rows = jnp.concatenate([q_main, q_paths.reshape(b, -1, n_vocab)], axis=1)
  det_rows = jnp.concatenate([jnp.zeros(draft.shape, bool),
                              jnp.broadcast_to(d == j, path_tokens.shape).reshape(b, -1)], axis=1)
  return proposal.replace(q=_node_table(t, jnp.zeros_like(q_main[:, :1]), rows),
                          deterministic=_node_table(t, jnp.zeros((b, 1), bool), det_rows))


def _autoregressive_draft(model, cache, spec: Spec, key, anchor, lengths):
  """gamma tokens from the AR drafter, which also consumes the last draft so that every accepted
  token is in its cache. Returns drafts [B, gamma], their q [B, gamma, V] (None when greedy) and
  the extended drafter cache."""
  gamma = spec.block_size - 1

  def step(carry, i):
    cache, token = carry
    mask = jnp.concatenate([cache.visible()[:, None, :], jnp.ones((token.shape[0], 1, 1), bool)],
                           axis=-1)
    out = model(token[:, None], (lengths + i)[:, None], cache, mask)
    nxt, q = choose(spec, jax.random.fold_in(key, i), model.logits(out.hidden[:, 0]))
    q = jnp.zeros((token.shape[0], 0)) if q is None else q
    return (cache.append(out.k, out.v, jnp.ones_like(lengths)), nxt), (nxt, q)

  (cache, _), (drafts, qs) = jax.lax.scan(step, (cache, anchor), jnp.arange(gamma + 1))
  q_main = None if spec.sampling.greedy else jnp.moveaxis(qs[:gamma], 0, 1)
  return drafts[:gamma].T, q_main, cache


def resync(drafter, dcache, spec: Spec, proposal: Proposal, features, path, lengths, count):
  """Brings the drafter to the committed tokens: count [B] nodes along path were committed."""
  if spec.method == "ar":
    return dcache
  if spec.method == "ar_draft":  # its cache already holds the drafts; keep the accepted ones
    return dcache.replace(lengths=lengths + count)
  t = proposal.tree
  nodes = path
  if spec.method == "cure" and not spec.cure.resync:  # the ablation: branch-0 slots, stale
    slots = jnp.arange(path.shape[1])[None]
    is_b0 = (jnp.take_along_axis(t.branch, jnp.minimum(slots, t.size - 1), axis=1) == 0) & (
        slots < t.size)
    nodes = jnp.where(is_b0, slots, path)
  feats = jnp.take_along_axis(features, nodes[..., None], axis=1)          # [B, K, n*H]
  positions = lengths[:, None] + jnp.arange(path.shape[1])[None]
  k, v = drafter.context_kv(feats, positions)
  return dcache.append(k, v, count)


def commit_target(cache: KVCache, out, path, count) -> KVCache:
  """Moves the accepted nodes' keys/values into contiguous slots after the committed prefix."""
  return cache.append(take_tokens(out.k, path), take_tokens(out.v, path), count)
