"""The uncertainty gate: where to repair a draft block and how many alternatives to try.

Margins are top-1 minus top-2 of the raw draft logits. Positions under `tau_margin` are
uncertainty focal points (UFPs); up to `max_repair_positions` of them are chosen by one of three
rules (the paper's lowest margin, the earliest, or the highest expected gain) and each gets a
branch budget b. Repair paths (UFP u, alternative rank i < b_u) are then numbered in that order
and capped at `beam_width`.
"""

from __future__ import annotations

import dataclasses

import chex
import jax
import jax.numpy as jnp
from flax import struct

from cure_jax.models.layers import max_argmax

SELECT_RULES = ("margin", "earliest", "expected_gain")


@dataclasses.dataclass(frozen=True)
class RepairConfig:
  tau_margin: float = 1.0
  margin_scale: float = 2.0
  b_min: int = 1
  b_max: int = 5
  dynamic: bool = True
  select: str = "margin"
  max_repair_positions: int = 1
  v_max: int = 64
  max_depth: int = 15
  beam_width: int = 5
  keep_branch0: bool = True
  resync: bool = True
  topk: int = 4                  # ddtree: candidates per depth; hybrid: sibling leaves per node
  online: bool = False           # cure/hybrid: repair only while the efficiency model says so
  # online costs in any one unit; all four 0 = timed on the device at start-up
  cost_draft: float = 1.0        # online: C_d, one drafter block pass (any unit, e.g. ms)
  cost_redraft: float = 1.0      # online: the re-draft pass over the repair paths
  cost_verify_base: float = 1.0  # online: C_v(n) = base + per_node * n
  cost_verify_per_node: float = 0.0
  online_decay: float = 0.8      # online: weight of the past in the running means
  explore_every: int = 8         # online: try the tree at least once in this many iterations

  @property
  def costs(self) -> tuple[float, float, float, float]:
    return (self.cost_draft, self.cost_redraft, self.cost_verify_base, self.cost_verify_per_node)

  @property
  def num_paths(self) -> int:
    return min(self.beam_width, self.max_repair_positions * self.b_max)

  def range_problems(self) -> list[str]:
    """What is out of range whatever the drafter's block size: checked for every method, since
    a method that does not read a setting (or overrides it, as auto does v_max) would otherwise
    run without a word."""
    problems = []
    if self.tau_margin < 0:
      problems.append(f"tau_margin={self.tau_margin} must be >= 0 (0 disables repair)")
    if self.margin_scale <= 0:
      problems.append(f"margin_scale={self.margin_scale} must be > 0")
    if not 1 <= self.b_min <= self.b_max:
      problems.append(f"b_min={self.b_min}, b_max={self.b_max}: need 1 <= b_min <= b_max")
    if self.select not in SELECT_RULES:
      problems.append(f"select={self.select!r} must be one of {SELECT_RULES}")
    if self.max_repair_positions < 1:
      problems.append(f"max_repair_positions={self.max_repair_positions} must be >= 1")
    if self.beam_width < 1:
      problems.append(f"beam_width={self.beam_width} must be >= 1")
    if self.max_depth < 1:
      problems.append(f"max_depth={self.max_depth} must be >= 1")
    if self.v_max < 2:
      problems.append(f"v_max={self.v_max} must be >= 2 (the root and a drafted node)")
    if self.topk < 1:
      problems.append(f"topk={self.topk} must be >= 1")
    if min(self.costs) < 0 or (any(self.costs) and self.cost_draft + self.cost_verify_base <= 0):
      problems.append(f"cost_draft, cost_redraft, cost_verify_base, cost_verify_per_node="
                      f"{self.costs} must be >= 0, with cost_draft + cost_verify_base > 0 (or "
                      "all four 0: timed on this device)")
    if not 0 <= self.online_decay < 1:
      problems.append(f"online_decay={self.online_decay} must lie in [0, 1)")
    if self.explore_every < 1:
      problems.append(f"explore_every={self.explore_every} must be >= 1")
    return problems

  def validate(self, block_size: int) -> None:
    problems = self.range_problems()
    if not self.max_depth <= block_size - 1:
      problems.append(f"max_depth={self.max_depth} must lie in 1..block_size-1={block_size - 1}")
    if 2 <= self.v_max < self.max_depth + 1:
      problems.append(f"v_max={self.v_max} is too small for branch 0 (root + {self.max_depth} "
                      f"nodes): use v_max >= {self.max_depth + 1}")
    if problems:
      raise ValueError("invalid cure config: " + "; ".join(problems))


@struct.dataclass
class Gate:
  positions: jax.Array  # [B, U] block position (1..K-1) of each chosen UFP, -1 if none
  margins: jax.Array    # [B, U] its margin (0 where none)
  branches: jax.Array   # [B, U] alternatives granted (0 where none)

  def only(self, keep) -> "Gate":
    """This gate for the sequences where keep [B], no focal point for the others."""
    k = keep[:, None]
    return Gate(positions=jnp.where(k, self.positions, -1),
                margins=jnp.where(k, self.margins, 0.0), branches=jnp.where(k, self.branches, 0))


def top_k(x, k: int):
  """`jax.lax.top_k` over the last axis for a small k: values and indices [..., k], ties to the
  lower index.

  XLA:CPU lowers `lax.top_k` on a matmul's output to a full sort inside the fused graph
  (measured 167 ms instead of 1.4 ms for 15 x 49,152 SmolLM2 draft logits), so elsewhere than
  on NVIDIA GPUs it is k max/argmax passes (_top_k_passes). XLA:GPU's TopK kernel reads x once
  where the passes read it k times (Qwen3-8B CURE at batch 8: 0.44 GB an iteration).
  """
  exact = lambda x: tuple(jax.lax.top_k(x, k))                       # noqa: E731
  return jax.lax.platform_dependent(x, cuda=exact, default=lambda x: _top_k_passes(x, k))


def _top_k_passes(x, k: int):
  """top_k as k passes, each an argmax and a mask of the one found."""
  iota = jnp.arange(x.shape[-1])
  values, indices = [], []
  for _ in range(k):
    v, i = max_argmax(x)
    values.append(v)
    indices.append(i)
    x = jnp.where(iota == i[..., None], -jnp.inf, x)
  return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def excluding(values, drafted, n: int):
  """The first n entries of values [..., M] (token ids, best first) other than drafted [...]:
  positions [..., n] into values. Used to list a drafted token's alternatives."""
  return jnp.argsort(values == drafted[..., None], axis=-1, stable=True)[..., :n]


def margins(logits):
  """Top-1 minus top-2 of raw draft logits [..., V] -> [...]."""
  return gap(top_k(logits, 2)[0])


def gap(top):
  """Top-1 minus top-2 of a top-k's values [..., k >= 2] -> [...]: the margins."""
  return top[..., 0] - top[..., 1]


def expected_gain(top_logits, logsumexp, budget):
  """Expected extra accepted tokens from repairing each position, by the drafter's own beliefs.

  P(prefix before j accepted) x P(top-1 wrong but one of the b alternatives right) x
  (1 + expected accepted run after j). top_logits [B, K-1, b_max+1] (descending),
  logsumexp [B, K-1], budget [B, K-1] -> [B, K-1].
  """
  probs = jnp.exp(top_logits - logsumexp[..., None])                       # [B, K-1, b_max+1]
  p1 = probs[..., 0]
  ranks = jnp.arange(1, probs.shape[-1])
  alt_mass = jnp.sum(probs[..., 1:] * (ranks <= budget[..., None]), axis=-1)
  prefix = jnp.cumprod(jnp.concatenate([jnp.ones_like(p1[:, :1]), p1[:, :-1]], axis=1), axis=1)
  run = jnp.zeros_like(p1[:, 0])
  runs = []
  for i in range(p1.shape[1] - 1, -1, -1):  # run_i = sum_{k>i} prod_{i<m<=k} p1_m
    runs.append(run)
    run = p1[:, i] * (1.0 + run)
  return prefix * alt_mass * (1.0 + jnp.stack(runs[::-1], axis=1))


def select(logits, draft, draft_len, cfg: RepairConfig, top=None):
  """Chooses UFPs from draft logits [B, K-1, V]; draft [B, K-1] the drafted tokens; draft_len
  [B] usable positions; top: top_k(logits, b_max + 1) where the caller has it.

  Returns the Gate and the alternatives [B, K-1, b_max]: the best-ranked tokens other than the
  drafted one (ranks 2..b_max+1 under greedy drafting).
  """
  chex.assert_rank(logits, 3)
  b, km1, _ = logits.shape
  chex.assert_shape(draft, (b, km1))
  chex.assert_shape(draft_len, (b,))
  chex.assert_type([logits, draft, draft_len], [float, int, int])
  top, idx = top_k(logits, cfg.b_max + 1) if top is None else top           # [B, K-1, b_max+1]
  margins = gap(top)
  if cfg.dynamic:
    u = jnp.clip(1.0 - margins / cfg.margin_scale, 0.0, 1.0)
    budget = cfg.b_min + jnp.round(u * (cfg.b_max - cfg.b_min)).astype(jnp.int32)
  else:
    budget = jnp.full(margins.shape, cfg.b_max, jnp.int32)
  pos = jnp.arange(margins.shape[1])[None]                                  # block position - 1
  ok = (margins < cfg.tau_margin) & (pos < draft_len[:, None]) & (pos < cfg.max_depth)
  if cfg.select == "margin":
    score = margins
  elif cfg.select == "earliest":
    score = jnp.broadcast_to(pos, margins.shape).astype(jnp.float32)
  else:
    score = -expected_gain(top, jax.nn.logsumexp(logits, axis=-1), budget)
  score = jnp.where(ok, score, jnp.inf)
  u = cfg.max_repair_positions
  _, chosen = jax.lax.top_k(-score, min(u, score.shape[1]))                # best first
  chosen_ok = jnp.take_along_axis(ok, chosen, axis=1)
  if chosen.shape[1] < u:  # fewer block positions than UFP slots
    pad = ((0, 0), (0, u - chosen.shape[1]))
    chosen, chosen_ok = jnp.pad(chosen, pad), jnp.pad(chosen_ok, pad)
  gate = Gate(
      positions=jnp.where(chosen_ok, chosen + 1, -1),
      margins=jnp.where(chosen_ok, jnp.take_along_axis(margins, chosen, axis=1), 0.0),
      branches=jnp.where(chosen_ok, jnp.take_along_axis(budget, chosen, axis=1), 0),
  )
  alternatives = jnp.take_along_axis(idx, excluding(idx, draft, cfg.b_max), axis=-1)
  chex.assert_shape([gate.positions, gate.margins, gate.branches], (b, u))
  chex.assert_shape(alternatives, (b, km1, cfg.b_max))
  return gate, alternatives


def repair_paths(gate: Gate, alternatives, num_paths: int):
  """Numbers the repair paths (UFP order, then alternative rank) and keeps num_paths of them.

  Returns focal depth [B, R], substituted token [B, R] and validity [B, R].
  """
  chex.assert_rank(gate.positions, 2)
  b, u = gate.positions.shape
  chex.assert_shape([gate.margins, gate.branches], (b, u))
  chex.assert_shape(alternatives, (b, None, None))
  chex.assert_type([gate.positions, gate.branches, alternatives], int)
  b_max = alternatives.shape[-1]
  rank = jnp.arange(b_max)
  pair_ok = (rank[None, None] < gate.branches[..., None]).reshape(b, u * b_max)
  key = jnp.where(pair_ok, jnp.arange(u * b_max)[None], u * b_max + jnp.arange(u * b_max)[None])
  order = jnp.argsort(key, axis=1)[:, :num_paths]                           # [B, R]
  valid = jnp.take_along_axis(pair_ok, order, axis=1)
  depth = jnp.take_along_axis(gate.positions, order // b_max, axis=1)
  alt_rows = jnp.take_along_axis(alternatives, jnp.maximum(depth - 1, 0)[..., None], axis=1)
  alt = jnp.take_along_axis(alt_rows, (order % b_max)[..., None], axis=2)[..., 0]
  chex.assert_shape([depth, alt, valid], (b, min(num_paths, u * b_max)))
  return jnp.where(valid, depth, 1), jnp.where(valid, alt, 0), valid
