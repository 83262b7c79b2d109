"""The long-context table: τ and TPOT as the context grows, full drafter context against windows.

Each prompt is a held-out HumanEval problem after other problems' code (prompt and solution),
as a user pasting a codebase would ask: about 1k, 4k and 8k tokens. Methods: ar (the reference
for TPOT and tokens), and chain, ddtree and cure with the DFlash drafter seeing the whole
context or only its last `window` positions (drafter.window). A window changes what the
drafter proposes, never what is emitted: every output must equal ar's.
"""

from __future__ import annotations

import dataclasses

from cure_jax.analysis.report import md_table, num, save_figure
from cure_jax.runtime import prompts as prompts_lib
from experiments.tables.bench import Bench, Variant, run_variants, summarize, write_outputs

CONTEXTS = (1024, 4096, 8192)
WINDOWS = (0, 1024, 256)                 # 0: the whole context
TARGETS = 3                              # problems to complete, per context length
CONTEXT_FROM = 8                         # context problems: HumanEval 8 on (0-63 are held out)


def long_context_variants(windows=WINDOWS) -> list[Variant]:
  out = [Variant.of("ar", "ar")]
  for method in ("chain", "ddtree", "cure"):
    out += [Variant.of(f"{method} " + (f"w{w}" if w else "full"), method, window=w)
            for w in windows]
  return out


def _bench_at(bench: Bench, tokens: int, targets: int) -> Bench:
  """A Bench of its own whose prompts are `targets` problems after ~`tokens` of context."""
  rows = prompts_lib.humaneval_prompts()
  context = rows[CONTEXT_FROM:64]
  long_rows = [prompts_lib.with_context(rows[i], context, bench.tokenizer, tokens)
               for i in range(targets)]
  ids = prompts_lib.encode(long_rows, bench.tokenizer, bool(bench.config.chat_template),
                           bench.target.cfg.vocab_size)
  return dataclasses.replace(bench, rows=long_rows, ids=ids, runs={}, generators={})


def table_long_context(bench: Bench, contexts=CONTEXTS, windows=WINDOWS,
                       targets: int = TARGETS) -> dict:
  if bench.tokenizer is None:
    raise ValueError("the long-context table builds text prompts: the target needs a tokenizer")
  variants = long_context_variants(windows)
  rows = []
  for tokens in contexts:
    sub = _bench_at(bench, tokens, targets)
    runs = run_variants(sub, variants, list(range(targets)), f"long context {tokens}")
    ar = summarize(runs["ar"])
    for v in variants:
      s = summarize(runs[v.label], None if v.label == "ar" else runs["ar"])
      s.update(method=v.method, window=v.window, label=v.label, context_tokens=tokens,
               prompt_tokens=[len(i) for i in sub.ids], vs_ar=ar["tpot_ms"] / s["tpot_ms"])
      rows.append(s)
  payload = dict(contexts=list(contexts), windows=list(windows), targets=targets,
                 context_problems=f"HumanEval {CONTEXT_FROM}-63", rows=rows)
  md = [f"## Long context: HumanEval 0-{targets - 1} after other problems' code (HumanEval "
        f"{CONTEXT_FROM}-63), max_new_tokens={bench.config.max_new_tokens}, batch 1; drafter "
        "window w = the last w context positions (full: all)", "",
        md_table(["context", "prompt tokens", "method", "τ", "TPOT ms", "vs ar", "≠ ar"],
                 [[r["context_tokens"], "/".join(map(str, r["prompt_tokens"])), r["label"],
                   num(r["tau"]), num(r["tpot_ms"], ".1f"), num(r["vs_ar"], ".2f", "×"),
                   r.get("mismatches_vs_ar", 0)] for r in rows])]
  _plot(bench, rows, windows)
  return write_outputs(bench, "long_context", payload, "\n".join(md) + "\n")


def _plot(bench: Bench, rows, windows) -> None:
  """long_context.png: τ and TPOT against context, a line per method and window."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax_tau, ax_tpot) = plt.subplots(1, 2, figsize=(10, 4))
  styles = {w: s for w, s in zip(windows, ("-", "--", ":", "-."))}
  for label in dict.fromkeys(r["label"] for r in rows):
    mine = [r for r in rows if r["label"] == label]
    x = [r["context_tokens"] for r in mine]
    kw = dict(label=label, marker="o", linestyle=styles.get(mine[0]["window"], "-"))
    if mine[0]["method"] != "ar":
      ax_tau.plot(x, [r["tau"] for r in mine], **kw)
    ax_tpot.plot(x, [r["tpot_ms"] for r in mine], **kw)
  for ax, name in ((ax_tau, "τ (tokens per iteration)"), (ax_tpot, "TPOT (ms)")):
    ax.set_xscale("log", base=2)
    ax.set_xlabel("context tokens")
    ax.set_ylabel(name)
  ax_tpot.legend(fontsize=7, ncol=2)
  save_figure(fig, f"{bench.results_dir}/long_context.png")
  plt.close(fig)
