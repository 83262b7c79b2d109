"""Target-only greedy decoding: ours vs transformers `generate`, same weights, same run.

  python -m experiments.ar_vs_transformers --target=random      # a small random Qwen3
  python -m experiments.ar_vs_transformers --target=embedded:smollm2 --max_new_tokens=64
  python -m experiments.ar_vs_transformers --target=embedded:smollm2 --prompt_tokens=3000 \
    --num_prompts=2 --max_new_tokens=32        # long real prompts: HumanEval, one after another
"""

import json
import tempfile

import jax.numpy as jnp
import numpy as np
from absl import flags

from cure_jax.analysis import agreement as reference
from cure_jax.checkpoints.qwen3 import load_target
from cure_jax.runtime import distributed, errors, pipeline
from cure_jax.runtime.generation import Generator

_TARGET = flags.DEFINE_string("target", "random", "'random', 'embedded:smollm2' or an HF directory")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens per prompt")
_PROMPTS = flags.DEFINE_integer("num_prompts", 3, "prompts")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 0, "0: random prompts of 32 tokens; N: "
                                      "N tokens of HumanEval's problems one after another (prompt "
                                      "i starts at problem i), through the target's tokenizer")
_OUTPUT = flags.DEFINE_string("output", "", "JSON results path")


def main(argv):
  del argv
  distributed.announce_devices()
  with tempfile.TemporaryDirectory() as tmp:
    path = _TARGET.value
    if path == "random":
      path = reference.random_qwen3_dir(tmp)
    elif path.startswith("embedded:"):
      path = pipeline._embedded()[path]()
    target = load_target(path, jnp.float32, progress=False)
    prompts = reference.long_prompts(path, target.cfg.vocab_size, _PROMPTS.value,
                                     _PROMPT_TOKENS.value)
    gen = Generator(target, method="ar", max_new_tokens=_MAX_NEW.value)
    ours = [gen.generate([p])[0] for p in prompts]
    ours_tpot = float(np.median([r.tpot_ms for r in ours]))
    ref, ref_tpot = reference.transformers_tpot(path, prompts, _MAX_NEW.value)
  same = sum(r.output_ids == o for r, o in zip(ours, ref))
  result = dict(target=_TARGET.value, max_new_tokens=_MAX_NEW.value, prompts=len(prompts),
                prompt_tokens=[len(p) for p in prompts],
                compile_s=sum(gen.compile_s.values()), ours_tpot_ms=ours_tpot,
                transformers_tpot_ms=ref_tpot, speedup=ref_tpot / ours_tpot,
                identical_outputs=same)
  print(json.dumps(result, indent=1))
  if _OUTPUT.value:
    pipeline.write_json(_OUTPUT.value, result)


if __name__ == "__main__":
  errors.run(main)
