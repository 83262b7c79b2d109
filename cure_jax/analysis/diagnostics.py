"""Per-block records from decoding statistics, and the margin diagnostic to run before repair.

A decoding run (chain or cure) reports one stats dict per iteration (`Result.stats`). Each
iteration drafted one block: `block_records` turns those dicts into `BlockRecord`s that say what
the drafter believed (the K-1 top-1/top-2 margins of the main draft block) and what the target
did with branch 0 (how many draft tokens it accepted, hence where the first rejection fell).

`diagnose` answers the review's question "will CURE-style repair pay on this drafter?": if most
first rejections sit at low-margin positions and the gate's choice (the lowest margin) usually
*is* the first rejection, repairing there recovers tokens; if the drafter is confident
everywhere, or its lowest margin usually lies after the first rejection, the repair tree is
verification cost for nothing.

Conventions. Block positions run 1..K-1 (0 is the anchor). `branch0_accepted = a` means draft
positions 1..a were accepted and, when a < K-1, position a+1 is the first rejection. The last
iteration of every sequence is dropped by default: it is cut short by max_new_tokens or a stop
token, so its "rejection" may be an artefact of the cut.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Sequence

import numpy as np

MARGIN_BINS = tuple(float(x) for x in np.arange(0.0, 10.5, 0.5))  # 0..10 step 0.5, then overflow


@dataclasses.dataclass(frozen=True)
class BlockRecord:
  """One drafted block (one decoding iteration) of one prompt."""

  prompt: int                        # index of the prompt in the run
  iteration: int                     # iteration index within that prompt
  block_size: int                    # K
  branch0_accepted: int              # draft tokens branch 0 alone would have had accepted (0..K-1)
  accepted: int                      # draft tokens the winner had accepted (the bonus not counted)
  margins: tuple[float, ...] | None  # K-1 top1-top2 margins of the main block (None if unknown)
  ufp_positions: tuple[int, ...] = ()
  ufp_margins: tuple[float, ...] = ()
  branches: tuple[int, ...] = ()
  nodes_verified: int = 0
  winning_branch: int = 0
  repair_gain: int = 0
  prev_accept: int = 0               # accept length (incl. bonus) of the previous iteration

  @property
  def first_rejection(self) -> int | None:
    """Block position (1..K-1) of branch 0's first rejected draft token; None if all accepted."""
    return self.branch0_accepted + 1 if self.branch0_accepted < self.block_size - 1 else None

  @property
  def gate_fired(self) -> bool:
    return len(self.ufp_positions) > 0

  @property
  def lowest_margin_position(self) -> int | None:
    """Block position of the smallest margin (the paper's gate choice at tau = inf)."""
    if self.margins is None or not len(self.margins):
      return None
    return int(np.argmin(self.margins)) + 1


def _get(stats: dict, name: str, default):
  value = stats.get(name, default)
  return default if value is None else value


def block_records(runs: Sequence, block_size: int, drop_last: bool = True) -> list[BlockRecord]:
  """BlockRecords from per-prompt runs: each run is a `Result` (with .stats) or a stats list.

  Uses the stats fields `block_margins` and `branch0_accepted` when the decoder reports them;
  without them margins are unknown (None) and branch 0's acceptance is derived as
  accept_lengths - 1 - repair_gain (exact except on the truncated last iteration).
  """
  records = []
  for p, run in enumerate(runs):
    stats = run.stats if hasattr(run, "stats") else run
    stats = list(stats)
    if drop_last and stats:
      stats = stats[:-1]
    prev = 0
    for t, st in enumerate(stats):
      gain = int(_get(st, "repair_gain", 0))
      accept = int(st["accept_lengths"])
      b0 = st.get("branch0_accepted")
      b0 = max(accept - 1 - gain, 0) if b0 is None else int(b0)
      margins = st.get("block_margins")
      margins = None if margins is None else tuple(float(m) for m in margins)
      if margins is not None and len(margins) != block_size - 1:
        raise ValueError(f"prompt {p} iteration {t}: block_margins has {len(margins)} entries, "
                         f"expected block_size - 1 = {block_size - 1}")
      records.append(BlockRecord(
          prompt=p, iteration=t, block_size=block_size, branch0_accepted=b0,
          accepted=b0 + max(gain, 0), margins=margins,
          ufp_positions=tuple(int(x) for x in _get(st, "ufp_positions", ())),
          ufp_margins=tuple(float(x) for x in _get(st, "ufp_margins", ())),
          branches=tuple(int(x) for x in _get(st, "branches", ())),
          nodes_verified=int(_get(st, "nodes_verified", 0)),
          winning_branch=int(_get(st, "winning_branch", 0)), repair_gain=gain, prev_accept=prev))
      prev = accept
  return records


def histogram(values: Iterable[float], edges: Sequence[float] = MARGIN_BINS) -> dict:
  """Counts in [e_i, e_{i+1}) plus one overflow bin >= the last edge (values < e_0 go to bin 0)."""
  v = np.asarray(list(values), np.float64)
  idx = np.clip(np.searchsorted(np.asarray(edges), v, side="right") - 1, 0, len(edges) - 1)
  counts = np.bincount(idx, minlength=len(edges)) if v.size else np.zeros(len(edges), int)
  return dict(edges=[float(e) for e in edges], counts=[int(c) for c in counts],
              overflow_from=float(edges[-1]))


def _frac(num: int, den: int) -> float | None:
  return None if den == 0 else num / den


def _auc(scores_pos: np.ndarray, scores_neg: np.ndarray) -> float | None:
  """P(score of a random positive > score of a random negative), ties counted half."""
  if scores_pos.size == 0 or scores_neg.size == 0:
    return None
  allv = np.concatenate([scores_pos, scores_neg])
  order = allv.argsort(kind="mergesort")
  ranks = np.empty(allv.size)
  sorted_v = allv[order]
  # average ranks over ties
  i = 0
  while i < allv.size:
    j = i
    while j + 1 < allv.size and sorted_v[j + 1] == sorted_v[i]:
      j += 1
    ranks[order[i:j + 1]] = 0.5 * (i + j) + 1
    i = j + 1
  r_pos = ranks[:scores_pos.size].sum()
  return float((r_pos - scores_pos.size * (scores_pos.size + 1) / 2) /
               (scores_pos.size * scores_neg.size))


# Verdict thresholds (documented in the verdict's reasons).
MIN_GATE_RATE = 0.10     # the gate must fire on at least this share of blocks to matter
MIN_CONCENTRATION = 0.5  # at least this share of first rejections must be under tau
MIN_HIT_RATE = 0.25      # the chosen position must be the first rejection this often
MIN_LIFT = 2.0           # error rate under tau / error rate over tau


def diagnose(records: Sequence[BlockRecord], tau: float = 1.0,
             cure_records: Sequence[BlockRecord] | None = None) -> dict:
  """The margin diagnostic over blocks; JSON-ready dict with a textual `verdict`.

  records: blocks of a chain run (or any run; branch 0 is what is diagnosed). cure_records:
  blocks of a cure run, for where its gate actually fired and what it gained (by default the
  gated blocks of `records` themselves).
  """
  if not records:
    raise ValueError("no blocks to diagnose (every run had <= 1 iteration?)")
  k = records[0].block_size
  n = len(records)
  rejected = [r for r in records if r.first_rejection is not None]
  first_rej = histogram([r.first_rejection for r in rejected], edges=list(range(1, k)))
  out = dict(
      blocks=n, block_size=k, tau=tau,
      tau_mean=float(np.mean([r.branch0_accepted + 1 for r in records])),
      blocks_with_rejection=len(rejected),
      fully_accepted=n - len(rejected),
      first_rejection_hist=dict(positions=list(range(1, k)), counts=first_rej["counts"]),
  )
  with_margins = [r for r in records if r.margins is not None]
  out["margins_available"] = len(with_margins)
  if with_margins:
    all_m = np.concatenate([np.asarray(r.margins) for r in with_margins])
    out["margin_hist"] = histogram(all_m)
    out["margin_quantiles"] = {q: float(np.quantile(all_m, float(q)))
                               for q in ("0.1", "0.25", "0.5", "0.75", "0.9")}
    out["frac_positions_under_tau"] = float(np.mean(all_m < tau))
    out["gate_rate"] = float(np.mean([min(r.margins) < tau for r in with_margins]))
    out["mean_positions_under_tau"] = float(np.mean([sum(m < tau for m in r.margins)
                                                     for r in with_margins]))
    rej_m = [r for r in with_margins if r.first_rejection is not None]
    lowest = np.array([r.lowest_margin_position for r in rej_m])
    first = np.array([r.first_rejection for r in rej_m])
    out["lowest_is_first_rejection"] = _frac(int(np.sum(lowest == first)), len(rej_m))
    out["lowest_before_first_rejection"] = _frac(int(np.sum(lowest < first)), len(rej_m))
    out["lowest_after_first_rejection"] = _frac(int(np.sum(lowest > first)), len(rej_m))
    out["lowest_margin_hist"] = histogram([min(r.margins) for r in with_margins])
    rej_margin = np.array([r.margins[r.first_rejection - 1] for r in rej_m])
    out["first_rejection_margin_hist"] = histogram(rej_margin)
    out["first_rejection_under_tau"] = _frac(int(np.sum(rej_margin < tau)), len(rej_m))
    # Among blocks the gate fires on (some margin < tau) and that have a rejection: which rule
    # lands on the first rejection.
    fired = [r for r in rej_m if min(r.margins) < tau]
    hit_low = sum(r.lowest_margin_position == r.first_rejection for r in fired)
    hit_early = sum(next(i + 1 for i, m in enumerate(r.margins) if m < tau) == r.first_rejection
                    for r in fired)
    out["gated_blocks_with_rejection"] = len(fired)
    out["gate_lowest_hits_first_rejection"] = _frac(hit_low, len(fired))
    out["gate_earliest_hits_first_rejection"] = _frac(hit_early, len(fired))
    # Per reached position (1..min(a+1, K-1)): was the draft token wrong? Low vs high margin.
    wrong_lo = wrong_hi = seen_lo = seen_hi = 0
    m_wrong, m_right = [], []
    for r in with_margins:
      last = r.first_rejection or (k - 1)
      for pos in range(1, last + 1):
        m = r.margins[pos - 1]
        wrong = pos == r.first_rejection
        (m_wrong if wrong else m_right).append(m)
        if m < tau:
          seen_lo += 1
          wrong_lo += wrong
        else:
          seen_hi += 1
          wrong_hi += wrong
    out["error_rate_under_tau"] = _frac(wrong_lo, seen_lo)
    out["error_rate_over_tau"] = _frac(wrong_hi, seen_hi)
    out["reached_positions_under_tau"] = seen_lo
    out["reached_positions_over_tau"] = seen_hi
    # AUC of the margin as a detector of the wrong token (lower margin = more suspicious).
    out["margin_auc"] = _auc(-np.asarray(m_wrong, float), -np.asarray(m_right, float))
  gated = [r for r in (records if cure_records is None else cure_records) if r.gate_fired]
  if gated:  # a cure run: where did the gate put its repair, and did it pay
    rej_g = [r for r in gated if r.first_rejection is not None]
    pos = np.array([r.ufp_positions[0] for r in rej_g])
    first = np.array([r.first_rejection for r in rej_g])
    out["cure_gated_blocks"] = len(gated)
    out["cure_gate_rate"] = len(gated) / len(records if cure_records is None else cure_records)
    out["cure_gate_at_first_rejection"] = _frac(int(np.sum(pos == first)), len(rej_g))
    out["cure_gate_after_first_rejection"] = _frac(int(np.sum(pos > first)), len(rej_g))
    out["cure_useful_repairs"] = sum(r.repair_gain > 0 for r in gated)
    out["cure_useful_rate"] = sum(r.repair_gain > 0 for r in gated) / len(gated)
    out["cure_extra_tokens"] = int(sum(max(r.repair_gain, 0) for r in gated))
  out.update(_verdict(out, tau))
  return out


def _pct(x: float | None) -> str:
  return "n/a" if x is None else f"{100 * x:.1f}%"


def _verdict(d: dict, tau: float) -> dict:
  """Repair likely to pay or not, with the reasons (thresholds: module constants)."""
  reasons, blockers, advice = [], [], []
  if not d.get("margins_available"):
    gate_hit = d.get("cure_gate_at_first_rejection")
    if gate_hit is None:
      return dict(pays=None, reasons=[],
                  verdict="unknown: the stats carry no block margins and no gate decisions "
                  "(decode with a build that reports `block_margins`, or from a cure run)")
    useful = d.get("cure_useful_rate", 0.0)
    pays = gate_hit >= MIN_HIT_RATE and useful > 0
    reasons.append(f"the gate's position is the first rejection in {_pct(gate_hit)} of gated "
                   f"blocks with a rejection; {_pct(useful)} of gated blocks gained tokens")
    return dict(pays=pays, verdict=("repair likely to pay" if pays else "repair unlikely to pay")
                + " (partial diagnostic: no block margins)", reasons=reasons)
  gate_rate = d["gate_rate"]
  conc = d.get("first_rejection_under_tau")
  hit = d.get("gate_lowest_hits_first_rejection")
  early = d.get("gate_earliest_hits_first_rejection")
  lo, hi = d.get("error_rate_under_tau"), d.get("error_rate_over_tau")
  lift = None if lo is None or hi is None else (float("inf") if hi == 0 and lo > 0 else
                                                 (lo / hi if hi else None))
  reasons.append(f"{_pct(d['frac_positions_under_tau'])} of draft positions have margin < "
                 f"tau={tau:g}; the gate fires on {_pct(gate_rate)} of blocks")
  if gate_rate < MIN_GATE_RATE:
    blockers.append(f"the drafter is confident almost everywhere (gate fires on < "
                    f"{_pct(MIN_GATE_RATE)} of blocks): repair rarely triggers, so the tree mostly "
                    f"adds cost")
  if d["blocks_with_rejection"] == 0:
    blockers.append("no block has a rejection: there is nothing to repair")
  if conc is not None:
    reasons.append(f"{_pct(conc)} of first rejections sit at a margin < tau")
    if conc < MIN_CONCENTRATION:
      blockers.append(f"most first rejections happen at confident positions (< "
                      f"{_pct(MIN_CONCENTRATION)} under tau): the margin gate cannot find them")
  if lift is not None:
    reasons.append(f"error rate under tau {_pct(lo)} vs over tau {_pct(hi)} (lift {lift:.2f}x)")
    if lift < MIN_LIFT:
      blockers.append(f"low margins barely predict errors (lift < {MIN_LIFT:g}x)")
  best = max(x for x in (hit, early, 0.0) if x is not None)
  if hit is not None:
    reasons.append(f"in gated blocks with a rejection the lowest margin is the first rejection "
                   f"{_pct(hit)} of the time (after it: "
                   f"{_pct(d.get('lowest_after_first_rejection'))} over all rejected blocks), "
                   f"the earliest under-tau position {_pct(early)}")
    if best < MIN_HIT_RATE:
      blockers.append(f"neither the lowest-margin nor the earliest low-margin position is the "
                      f"first rejection often enough (< {_pct(MIN_HIT_RATE)}): repair lands where "
                      f"it cannot help")
    elif early is not None and hit is not None and early > hit + 0.05:
      advice.append("select='earliest' lands on the first rejection more often than the paper's "
                    "lowest-margin rule: prefer it")
  if "cure_useful_rate" in d:
    reasons.append(f"measured in the cure run: {_pct(d['cure_useful_rate'])} of gated blocks "
                   f"gained tokens ({d['cure_extra_tokens']} extra tokens)")
  pays = not blockers
  verdict = ("repair likely to pay: errors concentrate at low-margin positions the gate can find"
             if pays else "repair unlikely to pay: " + "; ".join(blockers))
  verdict += (" (whether it pays in wall-clock still depends on the verification cost curve: "
              "see the sweep table)")
  return dict(pays=pays, verdict=verdict, reasons=reasons + advice)


def markdown(d: dict) -> str:
  """A short markdown report of `diagnose`'s output."""
  lines = [f"## Margin diagnostic ({d['blocks']} blocks, K={d['block_size']}, tau={d['tau']:g})",
           "", f"**Verdict: {d['verdict']}**", ""]
  lines += [f"- {r}" for r in d.get("reasons", [])]
  lines += ["", "| statistic | value |", "|---|---|"]
  rows = [("blocks with a rejection", d["blocks_with_rejection"]),
          ("fully accepted blocks", d["fully_accepted"]),
          ("branch-0 tau (a+1)", f"{d['tau_mean']:.3f}")]
  for key, label in [("frac_positions_under_tau", "positions with margin < tau"),
                     ("gate_rate", "blocks with some margin < tau"),
                     ("first_rejection_under_tau", "first rejections with margin < tau"),
                     ("lowest_is_first_rejection", "lowest margin IS the first rejection"),
                     ("lowest_before_first_rejection", "lowest margin before the first rejection"),
                     ("lowest_after_first_rejection", "lowest margin after the first rejection"),
                     ("gate_lowest_hits_first_rejection", "gated: lowest margin hits"),
                     ("gate_earliest_hits_first_rejection", "gated: earliest < tau hits"),
                     ("error_rate_under_tau", "error rate at reached positions < tau"),
                     ("error_rate_over_tau", "error rate at reached positions >= tau"),
                     ("cure_gate_rate", "cure: gate fired"),
                     ("cure_gate_at_first_rejection", "cure: gate position = first rejection"),
                     ("cure_useful_rate", "cure: gated blocks with gain > 0")]:
    if d.get(key) is not None:
      rows.append((label, _pct(d[key])))
  if d.get("margin_auc") is not None:
    rows.append(("margin AUC for detecting the wrong token", f"{d['margin_auc']:.3f}"))
  if d.get("margin_quantiles"):
    rows.append(("margin quantiles 10/25/50/75/90%",
                 " / ".join(f"{v:.2f}" for v in d["margin_quantiles"].values())))
  lines += [f"| {a} | {b} |" for a, b in rows]
  counts = d["first_rejection_hist"]["counts"]
  lines += ["", "First rejection position (block position: count): " +
            ", ".join(f"{p}: {c}" for p, c in zip(d["first_rejection_hist"]["positions"], counts))
            + f"; none (all accepted): {d['fully_accepted']}"]
  return "\n".join(lines) + "\n"


def draw_margins(ax, d: dict) -> None:
  """The margin histogram of a diagnose() dict on a matplotlib axis, with the gate threshold."""
  h = d["margin_hist"]
  edges = h["edges"]
  width = edges[1] - edges[0]
  ax.bar(edges, h["counts"], width=width, align="edge", alpha=0.5, label="all block positions")
  if d.get("first_rejection_margin_hist"):
    ax.bar(edges, d["first_rejection_margin_hist"]["counts"], width=width, align="edge",
           alpha=0.8, label="first rejections")
  ax.axvline(d["tau"], color="k", ls="--", label=f"tau={d['tau']:g}")
  ax.set_xlabel(f"draft top-1 - top-2 logit margin (last bin: >= {h['overflow_from']:g})")
  ax.set_ylabel("positions")
  ax.set_title("Draft margins")
  ax.legend()


def plot(d: dict, margins_png: str | None, rejection_png: str | None, save) -> list[str]:
  """Margin and first-rejection histograms; `save(fig, path)` writes a figure. Returns paths."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  written = []
  if margins_png and d.get("margin_hist"):
    fig, ax = plt.subplots(figsize=(7, 4))
    draw_margins(ax, d)
    save(fig, margins_png)
    plt.close(fig)
    written.append(margins_png)
  if rejection_png:
    fig, ax = plt.subplots(figsize=(7, 4))
    pos = d["first_rejection_hist"]["positions"]
    ax.bar([str(p) for p in pos] + ["none"],
           d["first_rejection_hist"]["counts"] + [d["fully_accepted"]])
    ax.set_xlabel("block position of branch 0's first rejection")
    ax.set_ylabel("blocks")
    ax.set_title("Where the first rejection falls")
    save(fig, rejection_png)
    plt.close(fig)
    written.append(rejection_png)
  return written
