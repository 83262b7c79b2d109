"""CURE vs chain on random tiny target/drafter pairs: tau, nodes verified, step time.

Random pairs with a small vocabulary accept drafts often enough to exercise repair; the numbers
show the mechanism (and its cost per compiled step), not language-model quality.

  python -m experiments.random_pairs --pairs=8 --output=results/random_pairs.json
"""

import json

import numpy as np
from absl import flags

from cure_jax.runtime import distributed, errors, pipeline
from cure_jax.tree import repair
from cure_jax.runtime.generation import Generator
from cure_jax.analysis import random_models

_PAIRS = flags.DEFINE_integer("pairs", 8, "random target/drafter pairs")
_VOCAB = flags.DEFINE_integer("vocab", 8, "vocabulary size")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens per prompt")
_OUTPUT = flags.DEFINE_string("output", "", "JSON results path")


def main(argv):
  del argv
  distributed.announce_devices()
  arch = random_models.Arch(vocab=_VOCAB.value, block_size=8, target_layer_ids=(0, 2))
  methods = {
      "chain": dict(method="chain"),
      "cure (tau 1.0, margin)": dict(method="cure", cure=repair.RepairConfig(max_depth=7)),
      "cure (tau 1.0, earliest)": dict(method="cure", cure=repair.RepairConfig(
          max_depth=7, select="earliest")),
      "cure (always, v_max 32)": dict(method="cure", cure=repair.RepairConfig(
          tau_margin=1e9, max_depth=7, v_max=32)),
  }
  rows = {name: dict(tau=[], nodes=[], step_ms=[], equal_ar=0) for name in methods}
  for seed in range(_PAIRS.value):
    target, drafter = random_models.pair(arch, seed)
    batch = random_models.prompts(seed, arch.vocab, 4)
    ref = Generator(target, method="ar", max_new_tokens=_MAX_NEW.value).generate(batch)
    for name, kw in methods.items():
      gen = Generator(target, drafter, max_new_tokens=_MAX_NEW.value, **kw)
      gen.generate(batch)  # compile and warm up
      for r, a in zip(gen.generate(batch), ref):
        rows[name]["tau"] += r.accept_lengths
        rows[name]["nodes"] += [s["nodes_verified"] for s in r.stats]
        rows[name]["equal_ar"] += r.output_ids == a.output_ids
      rows[name]["step_ms"].append(1000 * r.decode_s / max(r.iterations, 1))
  table = {name: dict(tau=float(np.mean(v["tau"])), nodes_per_step=float(np.mean(v["nodes"])),
                      step_ms=float(np.median(v["step_ms"])),
                      equal_to_ar=f"{v['equal_ar']}/{4 * _PAIRS.value}")
           for name, v in rows.items()}
  print(json.dumps(table, indent=1))
  if _OUTPUT.value:
    pipeline.write_json(_OUTPUT.value, dict(pairs=_PAIRS.value, vocab=_VOCAB.value,
                                            max_new_tokens=_MAX_NEW.value, table=table))


if __name__ == "__main__":
  errors.run(main)
