"""CURE against chain on random tiny target/drafter pairs: τ, nodes verified a step, step time
and equality with target-only decoding. A small vocabulary makes drafts accepted often enough
to exercise repair; the numbers show the mechanism (and its cost per compiled step), not
language-model quality."""

from __future__ import annotations

import numpy as np

from cure_jax.analysis import random_models
from cure_jax.runtime.generation import Generator
from cure_jax.tree import repair

# the compared settings: Generator arguments by name
METHODS = {
    "chain": dict(method="chain"),
    "cure (tau 1.0, margin)": dict(method="cure", cure=repair.RepairConfig(max_depth=7)),
    "cure (tau 1.0, earliest)": dict(method="cure", cure=repair.RepairConfig(
        max_depth=7, select="earliest")),
    "cure (always, v_max 32)": dict(method="cure", cure=repair.RepairConfig(
        tau_margin=1e9, max_depth=7, v_max=32)),
}


def compare(pairs: int, vocab: int, max_new_tokens: int) -> dict[str, dict]:
  """Per setting of METHODS over `pairs` seeded pairs (4 prompts each): mean τ and nodes a step,
  median ms a step (second, compiled run) and prompts equal to target-only decoding's."""
  arch = random_models.Arch(vocab=vocab, block_size=8, target_layer_ids=(0, 2))
  rows = {name: dict(tau=[], nodes=[], step_ms=[], equal_ar=0) for name in METHODS}
  for seed in range(pairs):
    target, drafter = random_models.pair(arch, seed)
    batch = random_models.prompts(seed, arch.vocab, 4)
    ref = Generator(target, method="ar", max_new_tokens=max_new_tokens).generate(batch)
    for name, kw in METHODS.items():
      gen = Generator(target, drafter, max_new_tokens=max_new_tokens, **kw)
      gen.generate(batch)  # compile and warm up
      for r, a in zip(gen.generate(batch), ref):
        rows[name]["tau"] += r.accept_lengths
        rows[name]["nodes"] += [s["nodes_verified"] for s in r.stats]
        rows[name]["equal_ar"] += r.output_ids == a.output_ids
      rows[name]["step_ms"].append(1000 * r.decode_s / max(r.iterations, 1))
  return {name: dict(tau=float(np.mean(v["tau"])), nodes_per_step=float(np.mean(v["nodes"])),
                     step_ms=float(np.median(v["step_ms"])),
                     equal_to_ar=f"{v['equal_ar']}/{4 * pairs}")
          for name, v in rows.items()}
