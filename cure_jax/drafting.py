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


def _dflash_hidden(target, drafter, dcache, spec: Spec, anchor, lengths, limit, known=None):
  """One DFlash pass; known [B, A, K-1] tokens at block positions 1.. (mask id = unknown).

  Returns the block hidden states [B, A, K, H]: position d drafts the token at depth d.
  """
  k = spec.block_size
  b = anchor.shape[0]
  if known is None:
    known = jnp.full((b, 1, k - 1), spec.mask_token_id, jnp.int32)
  blocks = jnp.concatenate([jnp.broadcast_to(anchor[:, None, None], known.shape[:2] + (1,)),
                            known], axis=-1)                                # [B, A, K]
  positions = lengths[:, None] + jnp.arange(k)[None]                       # [B, K]
  return drafter(target.embed(blocks), positions, dcache, limit + 1)


def _dflash_logits(target, drafter, dcache, spec: Spec, anchor, lengths, limit):
  """The main draft block's float32 logits [B, K-1, V]."""
  hidden = _dflash_hidden(target, drafter, dcache, spec, anchor, lengths, limit)
  return drafter.draft_logits(hidden[:, 0, 1:], target.logits)


def _branch0_rows(tree, root_row, rows):
  """Per-node values [B, V, ...] from branch 0's rows [B, K-1, ...] (root_row for the root;
  nodes off branch 0 read an arbitrary row, for the caller to overwrite)."""
  table = jnp.concatenate([root_row, rows], axis=1)
  src = jnp.minimum(tree.source, table.shape[1] - 1)
  idx = src.reshape(src.shape + (1,) * (table.ndim - 2))
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
  logits = _dflash_logits(target, drafter, dcache, spec, anchor, lengths, limit)
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
  q = _branch0_rows(t, jnp.zeros_like(q_main[:, :1]), q_main)
  return Proposal(t, block_margins=margins, q=q, deterministic=jnp.zeros(t.valid.shape, bool))


def _repair_tree(target, drafter, dcache, spec: Spec, key, anchor, lengths, limit, draft, q_main,
                 logits) -> Proposal:
  """Branch 0 plus repair paths: alternatives at the gate's UFPs, suffixes re-drafted by DFlash
  with the substituted token (and the shared prefix) filled into the block.

  The tree's shape does not depend on the re-drafted tokens, so it is built first and the
  drafter's head runs only on the suffix nodes it kept (at most v_max rows instead of every
  path's K-1 positions: most of a repair suffix falls outside a small tree).
  """
  cfg = spec.cure
  k = spec.block_size
  gate, alternatives = repair.select(logits, draft, limit, cfg)
  depth, alt, valid = repair.repair_paths(gate, alternatives, cfg.num_paths)
  d = jnp.arange(1, k)[None, None]                                          # [1, 1, K-1]
  j = depth[..., None]
  known = jnp.where(d < j, draft[:, None], jnp.where(d == j, alt[..., None], spec.mask_token_id))
  t = tree_lib.build(anchor, draft, limit, v_max=cfg.v_max, keep_branch0=cfg.keep_branch0,
                     path_tokens=known, path_depth=depth, path_valid=valid)
  on_path = t.valid & (t.source >= k)                                       # [B, V] repair nodes
  path = jnp.where(on_path, (t.source - k) // (k - 1), 0)                  # [B, V] their path
  focal = jnp.take_along_axis(depth, path, axis=1)
  drafted = on_path & (t.depth > focal)                                     # re-drafted suffix
  b, v = t.tokens.shape
  n_vocab = logits.shape[-1]
  empty_q = jnp.zeros((b, v, 0 if spec.sampling.greedy else n_vocab))

  def redraft():
    hidden = _dflash_hidden(target, drafter, dcache, spec, anchor, lengths, limit, known)
    rows = hidden[jnp.arange(b)[:, None], path, t.depth]                    # [B, V, H]
    tokens, q = choose(spec, key, drafter.draft_logits(rows, target.logits))
    return tokens, empty_q if q is None else q

  suffix, q_suffix = jax.lax.cond(jnp.any(valid), redraft,
                                  lambda: (jnp.zeros((b, v), jnp.int32), empty_q))
  t = t.replace(tokens=jnp.where(drafted, suffix, t.tokens))
  proposal = Proposal(t, gate=gate, block_margins=repair.margins(logits))
  if spec.sampling.greedy:
    return proposal
  q = _branch0_rows(t, jnp.zeros_like(q_main[:, :1]), q_main)
  return proposal.replace(q=jnp.where(drafted[..., None], q_suffix, q),
                          deterministic=on_path & (t.depth == focal))


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
