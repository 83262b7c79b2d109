"""What a decoding method is: the small interface the loop, the generator and the pipeline call.

A method decides how one iteration's candidate tree is proposed and how its drafter follows the
committed tokens. The loop (runtime/decoding.py) is the same for every method: it asks
`spec.impl` (the registered Method) for the drafter's start state, the proposal, the rows of the
target's pass the drafter keeps, and the resync after a commit; the generator asks it for the
block size and the config checks. A new method is a subclass plus one `registry.register`.

Invariant shared by all: the target cache and the drafter state hold every committed token
except the anchor (the last one), which is the tree's root at position `lengths`.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from flax import struct

from cure_jax.methods import registry
from cure_jax.models.cache import take_tokens
from cure_jax.tree import candidates as tree_lib, controller, repair, sampling
from cure_jax.tree.sampling import Sampling


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
  prefill_chunk: int = 512                 # prompt tokens per prefill step (one compile for all)
  drafter_window: int = 0                  # DFlash: context positions drafts see; 0 = all
  draft_vocab: tuple[int, ...] = ()        # DFlash: token ids drafts may be; () = all
  cure: repair.RepairConfig | None = None
  sampling: Sampling = Sampling()
  auto: controller.Settings | None = None  # the goodput controller's budgets and costs

  def __post_init__(self):
    registry.get(self.method)  # a clear error for an unknown name

  @property
  def impl(self) -> "Method":
    """The registered Method behind `method`."""
    return registry.get(self.method)

  @property
  def max_depth(self) -> int:
    return self.impl.max_depth(self)

  @property
  def max_children(self) -> int:
    """Most children one tree node can have (siblings tested in turn when sampling)."""
    return self.impl.max_children(self)

  @property
  def online(self) -> bool:
    """The online budget decides per iteration whether to build the repair tree."""
    return self.impl.online(self)


@struct.dataclass
class Proposal:
  tree: tree_lib.Tree
  gate: repair.Gate | None = None
  block_margins: jax.Array | None = None  # [B, K-1] top-1 minus top-2 of the main draft
  q: jax.Array | None = None              # [B, V, N] distribution each node was drawn from
  deterministic: jax.Array | None = None  # [B, V] nodes placed by rank (one-hot q)
  path_logp: jax.Array | None = None      # [B, V] log q of each node's whole path (controller)


@struct.dataclass
class Verified:
  """What a commit keeps of the target's pass over the tree, gathered to K rows: keys/values
  (L x [B, K, KVH, D]) along the winning path and the features the drafter resyncs on
  [B, K, n*H] (None without a block drafter)."""

  k: tuple[jax.Array, ...]
  v: tuple[jax.Array, ...]
  features: jax.Array | None


def depth_limit(spec: Spec, lengths, produced, max_new=None):
  """Deepest useful tree depth: no deeper than the tokens still owed (of max_new [B], default
  spec.max_new_tokens) or the cache allows."""
  owed = (spec.max_new_tokens if max_new is None else max_new) - produced
  room = spec.max_len - 1 - lengths
  return jnp.clip(jnp.minimum(jnp.minimum(owed, room), spec.max_depth), 0, None)


def choose(spec: Spec, key, logits, first=None):
  """Draft tokens from logits [..., V]: argmax, or a draw from the warped distribution q.
  first [...]: the argmax, where the caller has it (a top-k's first index: the same token).

  Returns tokens [...] and q [..., V] (None when greedy)."""
  if spec.sampling.greedy:
    return (jnp.argmax(logits, axis=-1) if first is None else first).astype(jnp.int32), None
  q = sampling.warp(logits, spec.sampling)
  return sampling.draw(key, q), q


def log_q(spec: Spec, logits):
  """Log of the distribution drafts are taken from: softmax when greedy, else the warped q."""
  if spec.sampling.greedy:
    return jax.nn.log_softmax(logits, axis=-1)
  logq = jnp.log(sampling.warp(logits, spec.sampling))
  if isinstance(spec.sampling, sampling.Rows):   # rows at temperature 0: ranked as greedy's
    return jnp.where(spec.sampling.argmax_rows(logits), jax.nn.log_softmax(logits, axis=-1), logq)
  return logq


def branch0_rows(tree, root_row, rows):
  """Per-node values [B, V, ...] from branch 0's rows [B, K-1, ...] (root_row for the root;
  nodes off branch 0 read an arbitrary row, for the caller to overwrite)."""
  table = jnp.concatenate([root_row, rows], axis=1)
  src = jnp.minimum(tree.source, table.shape[1] - 1)
  idx = src.reshape(src.shape + (1,) * (table.ndim - 2))
  return jnp.take_along_axis(table, idx, axis=1)


def path_proposal(spec: Spec, anchor, draft, q_main, limit, logits=None) -> Proposal:
  """A single path: the anchor then draft [B, K-1] (cut at `limit`), each drawn from q_main."""
  t = tree_lib.build(anchor, draft, limit, v_max=spec.block_size)
  margins = None if logits is None else repair.margins(logits)
  if q_main is None:
    return Proposal(t, block_margins=margins)
  q = branch0_rows(t, jnp.zeros_like(q_main[:, :1]), q_main)
  return Proposal(t, block_margins=margins, q=q, deterministic=jnp.zeros(t.valid.shape, bool))


class Method:
  """One decoding method. The defaults describe a method with no drafter (`ar`); a subclass
  overrides what differs. Instances are stateless and registered once; everything per run is
  in the Spec, so the methods below are traced inside the compiled loop."""

  name: ClassVar[str] = ""
  drafter_kind: ClassVar[str | None] = None  # None, "block" (DFlash) or "autoregressive"
  tree_config: ClassVar[bool] = False        # reads the cure.* settings (RepairConfig)
  controlled: ClassVar[bool] = False         # the goodput controller picks its budget (auto.*)

  # --- host side: the generator and the pipeline ------------------------------------------------

  def block_size(self, drafter, requested: int | None, gamma: int | None = None) -> int:
    """K, the tree's depth + 1, from the user's request or the drafter's own."""
    del drafter, requested, gamma
    return 1

  def check(self, target, drafter) -> None:
    """Raises ValueError naming the fix when the target and drafter do not fit this method."""
    del target, drafter

  def tree_settings(self, target, block_size: int, cure: repair.RepairConfig | None,
                    draft_vocab: int = 0):
    """The checked tree settings to use (None when the method reads none); draft_vocab: the
    tokens the drafter may propose (0: the whole vocabulary)."""
    del target, block_size, cure, draft_vocab
    return None

  def spec_fields(self, drafter) -> dict:
    """Spec fields the drafter supplies (a block drafter: its mask token and target layers)."""
    del drafter
    return {}

  # --- inside the compiled loop -----------------------------------------------------------------

  def max_depth(self, spec: Spec) -> int:
    return spec.block_size - 1

  def max_children(self, spec: Spec) -> int:
    del spec
    return 1

  def online(self, spec: Spec) -> bool:
    del spec
    return False

  def init_drafter(self, drafter, spec: Spec, batch: int):
    """The drafter's state before the prompt (None without a drafter)."""
    del drafter, spec, batch
    return None

  def prefill_drafter(self, drafter, dcache, spec: Spec, target_out, tokens, positions, chunk):
    """The drafter's state after one prompt chunk: tokens, positions [B, T], target_out the
    target's output over them, chunk their Prefix (the first chunk.count tokens are real)."""
    del drafter, spec, target_out, tokens, positions, chunk
    return dcache

  def propose(self, target, drafter, dcache, spec: Spec, key, anchor, lengths, limit,
              want_tree=None):
    """This iteration's candidate tree, and the drafter state (an AR drafter extends it while
    drafting). want_tree [B] (online budget): sequences that may repair this time."""
    del target, drafter, spec, key, lengths, want_tree
    empty = jnp.zeros((anchor.shape[0], 0), jnp.int32)
    return Proposal(tree_lib.build(anchor, empty, limit, v_max=1)), dcache

  def features(self, spec: Spec, tree, out, path):
    """The target features [B, K, n*H] the drafter resyncs on (None: it reads none)."""
    del spec, tree, out, path
    return None

  def keep_verified(self, spec: Spec, tree, out, path) -> Verified:
    """Gathers the target output `out` over the tree's nodes to what a commit needs."""
    return Verified(k=take_tokens(out.k, path), v=take_tokens(out.v, path),
                    features=self.features(spec, tree, out, path))

  def resync(self, drafter, dcache, spec: Spec, verified: Verified, lengths, count):
    """Brings the drafter to the committed tokens: the first count [B] of the K kept rows."""
    del drafter, spec, verified, lengths, count
    return dcache
