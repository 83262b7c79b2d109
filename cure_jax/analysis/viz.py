"""Pictures for the notebooks: one CURE iteration's tree, draft margins against the gate,
the verification cost curve, and τ / tokens per second per method.

Each function draws on a matplotlib axis (a new figure when none is given) and returns the axis.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from cure_jax.analysis import diagnostics

COLORS = dict(root="#4c72b0", won="#2ca02c", rejected="#eeeeee", edge="#999999")


def _axis(ax, size):
  if ax is None:
    import matplotlib.pyplot as plt
    _, ax = plt.subplots(figsize=size)
  return ax


def token_label(token: int, tokenizer=None, width: int = 6) -> str:
  """A node's text: the decoded token (whitespace made visible), cut to `width`, or its id."""
  if tokenizer is None:
    return str(int(token))
  text = tokenizer.decode([int(token)])
  text = text.replace("\n", "\\n").replace("\t", "\\t").replace(" ", "·")
  return text if len(text) <= width else text[:width - 1] + "…"


def draw_tree(it, tokenizer=None, ax=None, title: str | None = None):
  """One iteration's candidate tree (a `replay.Iteration`): depth left to right, branch 0 on
  the top lane and each repair path on a lane below; green = accepted by the target (under greedy
  verification that is the winning path), grey = rejected; the dashed line marks each focal
  point the gate chose."""
  from matplotlib.patches import Patch

  nodes = np.flatnonzero(it.valid)
  lanes = int(max(it.branch[nodes].max(), 0)) + 1
  ax = _axis(ax, (max(6.5, 1.0 + 0.85 * int(it.depth[nodes].max() + 1)), 1.4 + 0.75 * lanes))
  won = set(it.path)  # the edges drawn bold
  xy = {int(n): (int(it.depth[n]), -max(int(it.branch[n]), 0)) for n in nodes}
  for n in nodes[1:]:
    (x0, y0), (x1, y1) = xy[int(it.parent[n])], xy[int(n)]
    on_path = int(n) in won
    ax.plot([x0, x1], [y0, y1], color=COLORS["won"] if on_path else COLORS["edge"],
            lw=2.5 if on_path else 1.0, zorder=1)
  for n in nodes:
    x, y = xy[int(n)]
    kind = "root" if n == 0 else "won" if it.accepted[n] else "rejected"
    ax.scatter([x], [y], s=900, color=COLORS[kind], edgecolors="k", linewidths=0.6, zorder=2)
    ax.text(x, y, token_label(it.tokens[n], tokenizer), ha="center", va="center", fontsize=6.5,
            color="white" if kind in ("root", "won") else "black", zorder=3)
  for pos, margin, b in zip(it.ufp_positions, it.ufp_margins, it.branches):
    ax.axvline(pos, color="#d62728", ls="--", lw=1, zorder=0)
    ax.text(pos, 0.5, f"focal point\nmargin {margin:.2f}, {b} alt.", color="#d62728",
            ha="center", va="bottom", fontsize=7, zorder=4,
            bbox=dict(facecolor="white", edgecolor="none", pad=1))
  ax.set_yticks([-lane for lane in range(lanes)],
                ["branch 0"] + [f"repair {r}" for r in range(1, lanes)])
  ax.set_xticks(range(int(it.depth[nodes].max()) + 1))
  ax.set_xlabel("depth (block position)")
  ax.set_ylim(-lanes + 0.4, 1.3)
  ax.set_xlim(-0.6, int(it.depth[nodes].max()) + 0.6)
  for side in ("top", "right", "left"):
    ax.spines[side].set_visible(False)
  ax.legend(handles=[Patch(color=COLORS[k], label=label) for k, label in
                     (("root", "root (anchor)"), ("won", "accepted: the winning path"),
                      ("rejected", "rejected, or below a rejected node"))],
            loc="upper center", fontsize=7, ncol=3, frameon=False,
            bbox_to_anchor=(0.5, -0.25 / lanes - 0.12))
  ax.set_title(title or (f"iteration {it.index}: {len(nodes)} nodes, winner "
                         f"{'branch 0' if it.winning_branch == 0 else f'repair {it.winning_branch}'}"
                         f", {len(it.path) - 1} accepted + bonus"), loc="left", fontsize=9)
  return ax


def margin_histogram(results: Sequence, block_size: int, tau: float, ax=None):
  """Draft margins of every block of chain / cure runs (`Result`s), with the gate threshold."""
  d = diagnostics.diagnose(diagnostics.block_records(results, block_size), tau)
  ax = _axis(ax, (7, 4))
  diagnostics.draw_margins(ax, d)
  ax.set_title(f"Draft margins: {100 * d['frac_positions_under_tau']:.0f}% of positions under "
               f"tau={tau:g}")
  return ax


def draw_cost_curve(ax, curve: Mapping[int, float], fontsize: int = 7):
  """Measured C_v(n) (ms per target forward over n tree nodes) and the flat GPU-like curve."""
  ns = sorted(curve)
  ax.plot(ns, [curve[n] for n in ns], "o-", label="measured C_v(n)")
  ax.plot(ns, [curve[ns[0]]] * len(ns), "--", label="flat GPU-like")
  ax.set_xlabel("tree nodes n")
  ax.set_ylabel("ms per target forward")
  ax.set_title("verification cost curve")
  ax.set_ylim(bottom=0)
  ax.legend(fontsize=fontsize)
  return ax


def cost_curve(curve: Mapping[int, float], ax=None):
  return draw_cost_curve(_axis(ax, (6, 4)), curve, fontsize=9)


def method_bars(summaries: Mapping[str, Mapping], axes=None):
  """τ and tokens/s side by side per method; summaries: label -> pipeline.summary() dict."""
  if axes is None:
    import matplotlib.pyplot as plt
    _, axes = plt.subplots(1, 2, figsize=(9, 3.2))
  labels = list(summaries)
  for ax, key, name in zip(axes, ("tau", "tokens_per_s"), ("τ (tokens per iteration)",
                                                           "tokens / s")):
    values = [summaries[m][key] for m in labels]
    bars = ax.bar(labels, values, color=["#8c8c8c", "#4c72b0", "#2ca02c", "#dd8452"][:len(labels)])
    ax.bar_label(bars, [f"{v:.2f}" if key == "tau" else f"{v:.1f}" for v in values], fontsize=8)
    ax.set_title(name)
    ax.spines[["top", "right"]].set_visible(False)
  return axes
