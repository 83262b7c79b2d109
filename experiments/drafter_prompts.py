"""Prompts for drafter training data, built here from packages, never from an evaluation set.

Sources: HumanEval 64-163 in four framings (0-63 are the evaluation problems of every table),
HumanEval-style stubs from standard-library signatures and docstrings and instructions derived
from them, synthetic coding tasks, explanation questions, and arithmetic word problems from
templates. The held-out maths set (`--heldout_out`) comes from templates the training prompts
never use, with other names and numbers: a drafter is judged on problems it never saw.

    python -m experiments.drafter_prompts --out=runs/drafter_prompts.jsonl
"""

from __future__ import annotations

import json

from absl import flags

from cure_jax.runtime import errors, pipeline
from cure_jax.training import drafter_prompts

_OUT = flags.DEFINE_string("out", "runs/drafter_prompts.jsonl", "Training prompts (JSONL).")
_HELDOUT = flags.DEFINE_string("heldout_out", "cure_jax/assets/prompts/maths_heldout.jsonl",
                               "Held-out maths word problems (JSONL); '' to skip.")
_MATHS = flags.DEFINE_integer("maths", 2000, "Training maths word problems.")
_HELDOUT_N = flags.DEFINE_integer("heldout", 64, "Held-out maths word problems.")
_SEED = flags.DEFINE_integer("seed", 0, "Shuffle / sampling seed.")


def _write_jsonl(path: str, rows: list[dict]) -> None:
  pipeline.write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows).encode())


def main(argv):
  del argv
  rows = drafter_prompts.training_prompts(_SEED.value, _MATHS.value)
  _write_jsonl(_OUT.value, rows)
  by_src: dict[str, int] = {}
  for r in rows:
    by_src[r["src"]] = by_src.get(r["src"], 0) + 1
  print(f"wrote {len(rows)} training prompts to {_OUT.value}: {by_src}")
  if _HELDOUT.value:
    held = drafter_prompts.heldout_maths(_SEED.value, _HELDOUT_N.value)
    _write_jsonl(_HELDOUT.value, held)
    print(f"wrote {len(held)} held-out maths problems to {_HELDOUT.value}")


if __name__ == "__main__":
  errors.run(main)
