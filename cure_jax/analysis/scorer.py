"""The paper's offline repair-utility scorer (its Table 5).

Candidate blocks are the iterations of a cure run where the gate fired (a repair tree was
built). Each gets a feature vector known right after the tree is built (draft margins, where
the focal point sits, the branch budget, tree size, the previous iteration's acceptance), a label
(the repair was useful: repair_gain > 0) and a value (repair_gain, the extra accepted tokens). A
small model (logistic regression or a one-hidden-layer MLP, trained with optax) is fitted on
one split of the prompts and ranks the blocks of the other; admitting the top fraction r of
blocks by score gives

  precision           = useful admitted / admitted
  recall              = useful admitted / useful
  extra-token recall  = gain of admitted / total gain

reported next to trivial rankings: random (the expectation), lowest UFP margin, earliest UFP,
and the oracle (ranking by the gain itself; the ceiling).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from cure_jax.analysis.diagnostics import BlockRecord

BUDGETS = (0.1, 0.3)
MARGIN_CAP = 20.0  # margins are clipped here so a few huge ones do not dominate the features

BASE_FEATURES = ("ufp_margin", "ufp_position", "ufp_position_frac", "branches", "num_ufps",
                 "nodes_verified", "prev_accept")
MARGIN_FEATURES = ("block_min_margin", "block_mean_margin", "block_std_margin",
                   "positions_under_tau", "ufp_margin_rank", "prefix_min_margin",
                   "prefix_under_tau", "prefix_mean_margin", "next_margin",
                   "second_lowest_gap")


def feature_names(with_margins: bool) -> tuple[str, ...]:
  return BASE_FEATURES + (MARGIN_FEATURES if with_margins else ())


def block_features(r: BlockRecord, tau: float, with_margins: bool) -> np.ndarray:
  """The feature vector of one gated block (see `feature_names`)."""
  if not r.gate_fired:
    raise ValueError(f"block (prompt {r.prompt}, iteration {r.iteration}) has no UFP")
  k1 = r.block_size - 1
  j = r.ufp_positions[0]
  mj = min(r.ufp_margins[0], MARGIN_CAP)
  f = [mj, j, j / k1, r.branches[0] if r.branches else 0, len(r.ufp_positions),
       r.nodes_verified, r.prev_accept]
  if with_margins:
    if r.margins is None:
      raise ValueError("with_margins=True needs block margins on every record")
    m = np.minimum(np.asarray(r.margins, np.float64), MARGIN_CAP)
    prefix = m[:j - 1]
    srt = np.sort(m)
    f += [m.min(), m.mean(), m.std(), float(np.sum(m < tau)),
          float(np.sum(m < m[j - 1])),                       # rank of the UFP's margin
          prefix.min() if prefix.size else MARGIN_CAP,
          float(np.sum(prefix < tau)),
          prefix.mean() if prefix.size else MARGIN_CAP,
          m[j] if j < k1 else MARGIN_CAP,
          (srt[1] - srt[0]) if srt.size > 1 else MARGIN_CAP]
  return np.asarray(f, np.float64)


@dataclasses.dataclass
class Dataset:
  x: np.ndarray            # [N, F]
  useful: np.ndarray       # [N] bool: repair_gain > 0
  gain: np.ndarray         # [N] repair_gain (>= 0)
  prompt: np.ndarray       # [N] prompt index
  ufp_margin: np.ndarray   # [N] for the lowest-margin baseline
  ufp_position: np.ndarray  # [N] for the earliest baseline
  names: tuple[str, ...]

  def __len__(self) -> int:
    return len(self.useful)

  def subset(self, mask) -> "Dataset":
    return Dataset(self.x[mask], self.useful[mask], self.gain[mask], self.prompt[mask],
                   self.ufp_margin[mask], self.ufp_position[mask], self.names)


def dataset(records: Sequence[BlockRecord], tau: float,
            with_margins: bool | None = None) -> Dataset:
  """The gated blocks of `records` as a Dataset; margin features when every block has margins
  (or as forced by with_margins)."""
  gated = [r for r in records if r.gate_fired]
  if with_margins is None:
    with_margins = bool(gated) and all(r.margins is not None for r in gated)
  names = feature_names(with_margins)
  x = (np.stack([block_features(r, tau, with_margins) for r in gated]) if gated
       else np.zeros((0, len(names))))
  gain = np.array([max(r.repair_gain, 0) for r in gated], np.float64)
  return Dataset(x=x, useful=gain > 0, gain=gain, prompt=np.array([r.prompt for r in gated], int),
                 ufp_margin=np.array([r.ufp_margins[0] for r in gated], np.float64),
                 ufp_position=np.array([r.ufp_positions[0] for r in gated], np.float64),
                 names=names)


def split_by_prompt(data: Dataset, num_prompts: int | None = None,
                    train_fraction: float = 0.5) -> tuple[Dataset, Dataset]:
  """Train on the blocks of the first `train_fraction` of prompts, test on the rest."""
  n = num_prompts if num_prompts is not None else (int(data.prompt.max()) + 1 if len(data) else 0)
  cut = int(round(n * train_fraction))
  return data.subset(data.prompt < cut), data.subset(data.prompt >= cut)


@dataclasses.dataclass
class Scorer:
  """A fitted scorer: standardisation, the model kind and its parameters."""

  kind: str                 # "logreg" | "mlp"
  mean: np.ndarray
  std: np.ndarray
  params: dict
  names: tuple[str, ...]
  note: str = ""

  def score(self, x: np.ndarray) -> np.ndarray:
    z = jnp.asarray((np.asarray(x, np.float64) - self.mean) / self.std, jnp.float32)
    return np.asarray(_forward(self.kind, self.params, z), np.float64)

  def to_json(self) -> dict:
    return dict(kind=self.kind, names=list(self.names), mean=self.mean.tolist(),
                std=self.std.tolist(), note=self.note,
                params=jax.tree.map(lambda a: np.asarray(a).tolist(), self.params))


def _forward(kind: str, params, z):
  if kind == "logreg":
    return z @ params["w"] + params["b"]
  h = jnp.tanh(z @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


def train(data: Dataset, *, kind: str = "logreg", steps: int = 400, learning_rate: float = 0.05,
          l2: float = 1e-3, hidden: int = 16, seed: int = 0) -> Scorer:
  """Fits a logistic regression or a tiny MLP (full-batch Adam, class-balanced logistic loss)."""
  if kind not in ("logreg", "mlp"):
    raise ValueError(f"kind={kind!r}: choose 'logreg' or 'mlp'")
  f = data.x.shape[1]
  mean = data.x.mean(axis=0) if len(data) else np.zeros(f)
  std = data.x.std(axis=0) if len(data) else np.ones(f)
  std = np.where(std > 1e-9, std, 1.0)
  key = jax.random.PRNGKey(seed)
  if kind == "logreg":
    params = dict(w=jnp.zeros((f,), jnp.float32), b=jnp.zeros((), jnp.float32))
  else:
    k1, k2 = jax.random.split(key)
    params = dict(w1=jax.random.normal(k1, (f, hidden)) / math.sqrt(max(f, 1)),
                  b1=jnp.zeros((hidden,)), w2=jax.random.normal(k2, (hidden,)) / math.sqrt(hidden),
                  b2=jnp.zeros(()))
  pos = int(data.useful.sum())
  neg = len(data) - pos
  if pos == 0 or neg == 0:
    # Nothing to separate: a constant scorer (ties are broken at random when ranking).
    note = f"training split has {pos} useful and {neg} useless blocks: constant scorer"
    return Scorer(kind, mean, std, jax.tree.map(np.asarray, params), data.names, note)
  z = jnp.asarray((data.x - mean) / std, jnp.float32)
  y = jnp.asarray(data.useful, jnp.float32)
  # class balance: each class carries half of the loss
  weights = jnp.where(y > 0, 0.5 / pos, 0.5 / neg)
  opt = optax.adam(learning_rate)

  def loss_fn(p):
    logits = _forward(kind, p, z)
    ce = jnp.sum(weights * optax.sigmoid_binary_cross_entropy(logits, y))
    reg = sum(jnp.sum(v ** 2) for name, v in p.items() if name.startswith("w"))
    return ce + l2 * reg

  @jax.jit
  def fit(p):
    def step(carry, _):
      p, s = carry
      loss, g = jax.value_and_grad(loss_fn)(p)
      upd, s = opt.update(g, s, p)
      return (optax.apply_updates(p, upd), s), loss
    (p, _), losses = jax.lax.scan(step, (p, opt.init(p)), None, length=steps)
    return p, losses

  params, losses = fit(params)
  return Scorer(kind, mean, std, jax.tree.map(np.asarray, params), data.names,
                f"final training loss {float(losses[-1]):.4f}")


def admitted(scores: np.ndarray, r: float) -> int:
  """How many of N blocks a budget r admits: round(r N), at least 1 when N > 0."""
  n = len(scores)
  return 0 if n == 0 else min(n, max(1, int(round(r * n))))


def rank(scores: np.ndarray, seed: int = 0) -> np.ndarray:
  """Indices by descending score; ties in a seeded random order (no bias from block order)."""
  scores = np.asarray(scores, np.float64)
  tiebreak = np.random.default_rng(seed).permutation(len(scores))
  return np.lexsort((tiebreak, -scores))


def ranking_metrics(scores: np.ndarray, useful: np.ndarray, gain: np.ndarray,
                    budgets: Sequence[float] = BUDGETS, seed: int = 0) -> dict:
  """Precision, recall and extra-token recall of admitting the top r of blocks, per budget."""
  useful = np.asarray(useful, bool)
  gain = np.asarray(gain, np.float64)
  order = rank(scores, seed)
  out = {}
  for r in budgets:
    k = admitted(scores, r)
    top = order[:k]
    out[f"{r:g}"] = dict(
        admitted=k,
        precision=float(useful[top].mean()) if k else None,
        recall=float(useful[top].sum() / useful.sum()) if useful.sum() else None,
        extra_token_recall=float(gain[top].sum() / gain.sum()) if gain.sum() else None)
  return out


def random_metrics(useful: np.ndarray, gain: np.ndarray,
                   budgets: Sequence[float] = BUDGETS) -> dict:
  """The expectation under a uniformly random ranking (exact, not sampled)."""
  useful = np.asarray(useful, bool)
  gain = np.asarray(gain, np.float64)
  n = len(useful)
  out = {}
  for r in budgets:
    k = admitted(useful, r)
    out[f"{r:g}"] = dict(admitted=k, precision=float(useful.mean()) if n else None,
                         recall=(k / n) if useful.sum() else None,
                         extra_token_recall=(k / n) if gain.sum() else None)
  return out


def evaluate(records: Sequence[BlockRecord], tau: float, *, num_prompts: int | None = None,
             train_fraction: float = 0.5, budgets: Sequence[float] = BUDGETS,
             kinds: Sequence[str] = ("logreg", "mlp"), seed: int = 0, steps: int = 400) -> dict:
  """Trains on the first prompts, ranks the blocks of the rest; JSON-ready results."""
  data = dataset(records, tau)
  train_set, test_set = split_by_prompt(data, num_prompts, train_fraction)
  out = dict(
      features=list(data.names), margin_features=MARGIN_FEATURES[0] in data.names,
      blocks=len(records), gated_blocks=len(data), useful_blocks=int(data.useful.sum()),
      extra_tokens=float(data.gain.sum()),
      train=dict(blocks=len(train_set), useful=int(train_set.useful.sum())),
      test=dict(blocks=len(test_set), useful=int(test_set.useful.sum()),
                extra_tokens=float(test_set.gain.sum())),
      budgets=[float(b) for b in budgets], rankings={}, models={})
  if len(test_set) == 0:
    out["note"] = "no gated blocks in the test split: nothing to rank"
    return out
  u, g = test_set.useful, test_set.gain
  rankings = out["rankings"]
  for kind in kinds:
    model = train(train_set, kind=kind, seed=seed, steps=steps)
    rankings[f"scorer_{kind}"] = ranking_metrics(model.score(test_set.x), u, g, budgets, seed)
    out["models"][kind] = model.to_json()
  rankings["random"] = random_metrics(u, g, budgets)
  rankings["lowest_margin"] = ranking_metrics(-test_set.ufp_margin, u, g, budgets, seed)
  rankings["earliest_ufp"] = ranking_metrics(-test_set.ufp_position, u, g, budgets, seed)
  rankings["oracle"] = ranking_metrics(g, u, g, budgets, seed)
  return out


PAPER_TABLE5 = {"0.1": dict(precision=0.359, extra_token_recall=0.396),
                "0.3": dict(precision=0.246, extra_token_recall=0.716)}


def markdown(result: dict) -> str:
  """Table 5 as markdown: one row per ranking, precision / recall / extra-token recall per r."""
  budgets = [f"{b:g}" for b in result["budgets"]]
  head = ["ranking"] + [f"{m} @r={b}" for b in budgets
                        for m in ("precision", "recall", "extra-token recall")]
  lines = ["## Table 5: offline repair-utility scorer",
           "",
           f"{result['gated_blocks']} gated blocks of {result['blocks']} "
           f"({result['useful_blocks']} useful, {result['extra_tokens']:g} extra tokens); train "
           f"{result['train']['blocks']} blocks ({result['train']['useful']} useful), test "
           f"{result['test']['blocks']} blocks ({result['test']['useful']} useful). Features: "
           f"{', '.join(result['features'])}.", ""]
  if result.get("note"):
    lines += [f"Note: {result['note']}", ""]
  lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]

  def fmt(x):
    return "n/a" if x is None else f"{100 * x:.1f}%"

  for name, per in result["rankings"].items():
    cells = [name]
    for b in budgets:
      m = per[b]
      cells += [fmt(m["precision"]), fmt(m["recall"]), fmt(m["extra_token_recall"])]
    lines.append("| " + " | ".join(cells) + " |")
  paper = ["paper (Qwen3-8B)"]
  for b in budgets:
    p = PAPER_TABLE5.get(b, {})
    paper += [fmt(p.get("precision")), "n/a", fmt(p.get("extra_token_recall"))]
  lines.append("| " + " | ".join(paper) + " |")
  for kind, model in result.get("models", {}).items():
    if model.get("note"):
      lines.append(f"\n{kind}: {model['note']}")
  return "\n".join(lines) + "\n"
