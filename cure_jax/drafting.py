"""How each method proposes a candidate tree, and how its drafter catches up after a commit.

ar       no drafter: the tree is the root alone, the target emits one token.
chain    DFlash drafts K-1 tokens in one pass; the tree is that single path.
cure     chain plus repair paths at uncertainty focal points, each suffix re-drafted by DFlash.
ddtree   a best-first tree from the one DFlash pass's per-depth top-k (no second pass).
hybrid   cure, with the node budget it leaves free filled by sibling leaves, best first.
ar_draft a small autoregressive Qwen3 drafts gamma tokens one at a time; the tree is that path.

Invariant shared by all: the target cache and the drafter state hold every committed token
except the anchor (the last one), which is the tree's root at position `lengths`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from flax import struct

from cure_jax import best_first, repair, sampling, tree as tree_lib
from cure_jax.cache import KVCache, take_tokens
from cure_jax.sampling import Sampling

METHODS = ("ar", "chain", "cure", "ddtree", "hybrid", "ar_draft")
DFLASH_METHODS = ("chain", "cure", "ddtree", "hybrid")  # block drafters
TREE_METHODS = ("cure", "ddtree", "hybrid")             # set by Spec.cure (RepairConfig)
REPAIR_METHODS = ("cure", "hybrid")                     # gate + re-drafted suffixes


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
    return self.cure.max_depth if self.method in TREE_METHODS else self.block_size - 1

  @property
  def max_children(self) -> int:
    """Most children one tree node can have (siblings tested in turn when sampling)."""
    if self.method == "ddtree":
      return self.cure.topk
    if self.method == "hybrid":
      return 1 + self.cure.num_paths + self.cure.topk
    return 1 + self.cure.num_paths if self.method == "cure" else 1

  @property
  def online(self) -> bool:
    """The online budget decides per iteration whether to build the repair tree."""
    return self.method in REPAIR_METHODS and self.cure.online


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


def _log_q(spec: Spec, logits):
  """Log of the distribution drafts are taken from: softmax when greedy, else the warped q."""
  if spec.sampling.greedy:
    return jax.nn.log_softmax(logits, axis=-1)
  return jnp.log(sampling.warp(logits, spec.sampling))


def _alternatives(spec: Spec, log_q, drafted):
  """log q of each drafted token [...] and its topk best alternatives [..., A] with their log q
  (log_q [..., N]: the distribution it was drawn from)."""
  own = jnp.take_along_axis(log_q, drafted[..., None], axis=-1)[..., 0]
  logp, idx = repair.top_k(log_q, spec.cure.topk + 1)
  keep = repair.excluding(idx, drafted, spec.cure.topk)
  return (own, jnp.take_along_axis(idx, keep, axis=-1),
          jnp.take_along_axis(logp, keep, axis=-1))


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


def propose(target, drafter, dcache, spec: Spec, key, anchor, lengths, limit, want_tree=None):
  """Builds this iteration's candidate tree; returns it and the drafter cache (ar_draft extends
  it while drafting). want_tree [B] (online budget): sequences that may repair this time."""
  b = anchor.shape[0]
  if spec.method == "ar":
    empty = jnp.zeros((b, 0), jnp.int32)
    return Proposal(tree_lib.build(anchor, empty, limit, v_max=1)), dcache
  key_main, key_repair = jax.random.split(key)
  if spec.method == "ar_draft":
    draft, q_main, dcache = _autoregressive_draft(drafter, dcache, spec, key_main, anchor, lengths)
    return _chain(spec, anchor, draft, q_main, limit), dcache
  logits = _dflash_logits(target, drafter, dcache, spec, anchor, lengths, limit)
  if spec.method == "ddtree":
    return _ddtree(spec, anchor, limit, logits), dcache
  draft, q_main = choose(spec, key_main, logits)                             # [B, K-1(, V)]
  if spec.method == "chain":
    return _chain(spec, anchor, draft, q_main, limit, logits), dcache
  return _repair_tree(target, drafter, dcache, spec, key_repair, anchor, lengths, limit, draft,
                      q_main, logits, want_tree), dcache


def _chain(spec: Spec, anchor, draft, q_main, limit, logits=None) -> Proposal:
  t = tree_lib.build(anchor, draft, limit, v_max=spec.block_size)
  margins = None if logits is None else repair.margins(logits)
  if q_main is None:
    return Proposal(t, block_margins=margins)
  q = _branch0_rows(t, jnp.zeros_like(q_main[:, :1]), q_main)
  return Proposal(t, block_margins=margins, q=q, deterministic=jnp.zeros(t.valid.shape, bool))


def _ddtree(spec: Spec, anchor, limit, logits) -> Proposal:
  """The best-first tree over the main draft's per-depth top-k. Every node is placed by rank, so
  under sampling each is tested as a one-hot q (sampling without replacement from the residual),
  which is lossless whichever tokens were chosen."""
  logp, tokens = repair.top_k(_log_q(spec, logits), spec.cure.topk)        # [B, K-1, k]
  t = best_first.ddtree(anchor, tokens, logp, limit, v_max=spec.cure.v_max)
  proposal = Proposal(t, block_margins=repair.margins(logits))
  if spec.sampling.greedy:
    return proposal
  b, v = t.tokens.shape
  return proposal.replace(q=jnp.zeros((b, v, logits.shape[-1])),
                          deterministic=jnp.ones((b, v), bool))


def _repair_tree(target, drafter, dcache, spec: Spec, key, anchor, lengths, limit, draft, q_main,
                 logits, want_tree=None) -> Proposal:
  """Branch 0 plus repair paths: alternatives at the gate's UFPs, suffixes re-drafted by DFlash
  with the substituted token (and the shared prefix) filled into the block. The hybrid then
  fills the budget left free with sibling leaves (`_with_leaves`).

  The tree's shape does not depend on the re-drafted tokens, so it is built first and the
  drafter's head runs only on the suffix nodes it kept (at most v_max rows instead of every
  path's K-1 positions: most of a repair suffix falls outside a small tree).
  """
  cfg = spec.cure
  k = spec.block_size
  hybrid = spec.method == "hybrid"
  gate, alternatives = repair.select(logits, draft, limit, cfg)
  if want_tree is not None:
    gate = gate.only(want_tree)
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
  a = cfg.topk if hybrid else 0
  no_alts = (jnp.zeros((b, v)), jnp.zeros((b, v, a), jnp.int32), jnp.full((b, v, a), -jnp.inf))

  def redraft():
    hidden = _dflash_hidden(target, drafter, dcache, spec, anchor, lengths, limit, known)
    rows = hidden[jnp.arange(b)[:, None], path, t.depth]                    # [B, V, H]
    row_logits = drafter.draft_logits(rows, target.logits)                  # [B, V, N]
    tokens, q = choose(spec, key, row_logits)
    alts = _alternatives(spec, _log_q(spec, row_logits), tokens) if hybrid else no_alts
    return tokens, empty_q if q is None else q, alts

  suffix, q_suffix, suffix_alts = jax.lax.cond(
      jnp.any(valid), redraft, lambda: (jnp.zeros((b, v), jnp.int32), empty_q, no_alts))
  t = t.replace(tokens=jnp.where(drafted, suffix, t.tokens))
  placed = on_path & (t.depth == focal)                                     # by rank: one-hot q
  if hybrid:
    t = _with_leaves(spec, t, logits, draft, drafted, placed, suffix_alts, want_tree)
    placed = placed | (t.branch == leaf_branch(cfg))
  proposal = Proposal(t, gate=gate, block_margins=repair.margins(logits))
  if spec.sampling.greedy:
    return proposal
  q = _branch0_rows(t, jnp.zeros_like(q_main[:, :1]), q_main)
  return proposal.replace(q=jnp.where(drafted[..., None], q_suffix, q), deterministic=placed)


def leaf_branch(cfg: repair.RepairConfig) -> int:
  """Tree.branch of the hybrid's sibling leaves (after the repair paths' 1..num_paths)."""
  return cfg.num_paths + 1


def _with_leaves(spec: Spec, t, logits, draft, drafted, placed, suffix_alts, want_tree):
  """The hybrid's fill: each branch-0 node offers the other top tokens of the main draft at its
  depth, each re-drafted node those of its re-draft row (focal nodes offer none: branch 0's
  node at their depth already does, so every parent has one node offering); cumulative log q
  ranks them."""
  b, v = t.tokens.shape
  log_q = _log_q(spec, logits)                                              # [B, K-1, N]
  _, alt_main, alt_logp_main = _alternatives(spec, log_q, draft)           # [B, K-1, A]
  own_suffix, alt_suffix, alt_logp_suffix = suffix_alts                     # [B, V(, A)]
  rows = jnp.arange(b)[:, None]
  own_rank = log_q[rows, jnp.maximum(t.depth - 1, 0), t.tokens]            # focal: main q
  node_logp = jnp.where(drafted, own_suffix, own_rank)
  on_b0 = t.valid & (t.branch == 0) & (t.depth > 0)
  b0_alts = _branch0_rows(t, jnp.zeros_like(alt_main[:, :1]), alt_main)
  b0_logp = _branch0_rows(t, jnp.zeros_like(alt_logp_main[:, :1]), alt_logp_main)
  alt_tokens = jnp.where(drafted[..., None], alt_suffix, b0_alts)
  offers = (on_b0 | drafted) & ~placed
  if want_tree is not None:  # the online budget said chain: no leaves either
    offers = offers & want_tree[:, None]
  alt_logp = jnp.where(offers[..., None], jnp.where(drafted[..., None], alt_logp_suffix,
                                                    b0_logp), -jnp.inf)
  cum = best_first.cumulative(t, node_logp)
  return best_first.add_leaves(t, cum, alt_tokens, alt_logp, branch=leaf_branch(spec.cure),
                               max_depth=spec.max_depth)


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


@struct.dataclass
class Verified:
  """What a commit keeps of the target's pass over the tree, gathered to K rows: keys/values
  [L, B, K, KVH, D] along the winning path and the features the drafter resyncs on
  [B, K, n*H] (None without a block drafter)."""

  k: jax.Array
  v: jax.Array
  features: jax.Array | None


def resync_nodes(spec: Spec, tree, path):
  """Tree nodes [B, K] whose target features the drafter takes in: the winning path; under the
  no-resync ablation, branch 0's own nodes wherever branch 0 has one (stale after a repair)."""
  if spec.method not in REPAIR_METHODS or spec.cure.resync:
    return path
  slots = jnp.arange(path.shape[1])[None]
  is_b0 = (jnp.take_along_axis(tree.branch, jnp.minimum(slots, tree.size - 1), axis=1) == 0) & (
      slots < tree.size)
  return jnp.where(is_b0, slots, path)


def keep_verified(spec: Spec, tree, out, path) -> Verified:
  """Gathers the target output `out` over the tree's nodes to what a commit needs."""
  features = None
  if spec.method in DFLASH_METHODS:
    nodes = resync_nodes(spec, tree, path)
    features = jnp.take_along_axis(out.features, nodes[..., None], axis=1)  # [B, K, n*H]
  return Verified(k=take_tokens(out.k, path), v=take_tokens(out.v, path), features=features)


def resync(drafter, dcache, spec: Spec, verified: Verified, lengths, count):
  """Brings the drafter to the committed tokens: the first count [B] of the K kept rows."""
  if spec.method == "ar":
    return dcache
  if spec.method == "ar_draft":  # its cache already holds the drafts; keep the accepted ones
    return dcache.replace(lengths=lengths + count)
  positions = lengths[:, None] + jnp.arange(verified.features.shape[1])[None]
  k, v = drafter.context_kv(verified.features, positions)
  return dcache.append(k, v, count)


def commit_target(cache: KVCache, verified: Verified, count) -> KVCache:
  """Moves the accepted nodes' keys/values into contiguous slots after the committed prefix."""
  return cache.append(verified.k, verified.v, count)
