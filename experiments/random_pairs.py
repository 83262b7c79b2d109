"""CURE vs chain on random tiny target/drafter pairs: tau, nodes verified, step time.

Random pairs with a small vocabulary accept drafts often enough to exercise repair; the numbers
show the mechanism (and its cost per compiled step), not language-model quality
(cure_jax/analysis/random_pairs.py).

  python -m experiments.random_pairs --pairs=8 --output=results/random_pairs.json
"""

import json

from absl import flags

from cure_jax.analysis import random_pairs
from cure_jax.runtime import distributed, errors, pipeline

_PAIRS = flags.DEFINE_integer("pairs", 8, "random target/drafter pairs")
_VOCAB = flags.DEFINE_integer("vocab", 8, "vocabulary size")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens per prompt")
_OUTPUT = flags.DEFINE_string("output", "", "JSON results path")


def main(argv):
  del argv
  distributed.announce_devices()
  table = random_pairs.compare(_PAIRS.value, _VOCAB.value, _MAX_NEW.value)
  print(json.dumps(table, indent=1))
  if _OUTPUT.value:
    pipeline.write_json(_OUTPUT.value, dict(pairs=_PAIRS.value, vocab=_VOCAB.value,
                                            max_new_tokens=_MAX_NEW.value, table=table))


if __name__ == "__main__":
  errors.run(main)
