"""A trained drafter's τ (`experiments.train_drafter --stage=measure`): chain and cure with our
decoder on the config's measure prompts (HumanEval 0..n-1 by default), each method's outputs
checked against target-only decoding's."""

from __future__ import annotations

import time

import jax.numpy as jnp
import numpy as np

from cure_jax.checkpoints.dflash import load_drafter
from cure_jax.checkpoints.qwen3 import load_target
from cure_jax.runtime import pipeline, prompts as prompts_lib
from cure_jax.runtime.generation import Generator
from cure_jax.tree import repair


def measure(config) -> dict:
  """Chain and cure tau on HumanEval 0..n-1 with our decoder; checks outputs against target AR."""
  m = config.measure
  target_dir = pipeline.resolve_path(config.target.path)
  drafter_dir = pipeline.resolve_path(m.drafter or config.export.path)
  target = load_target(target_dir, jnp.float32, progress=False)
  drafter = load_drafter(drafter_dir, jnp.float32, progress=False, target_cfg=target.cfg)
  tokenizer = pipeline.load_tokenizer(target_dir)
  rows = (prompts_lib.read_jsonl(m.prompts_file) if m.prompts_file
          else prompts_lib.humaneval_prompts())[:m.prompts]
  ids = prompts_lib.encode(rows, tokenizer, True, target.cfg.vocab_size)
  stops = pipeline.stop_ids(target_dir, tokenizer)
  out, ref = {}, None
  for name in m.methods.split(","):
    method, _, select = name.partition(":")
    cure = (repair.RepairConfig(select=select, max_depth=drafter.cfg.block_size - 1)
            if method == "cure" else None)
    gen = Generator(target, drafter if method != "ar" else None, method=method,
                    max_new_tokens=m.new_tokens, stop_ids=stops, cure=cure)
    t0 = time.time()
    res = pipeline.decode_all(gen, ids, m.batch)
    lens = [a for r in res for a in r.accept_lengths]
    row = dict(tau=float(np.mean(lens)), iterations=len(lens),
               tokens=sum(len(r.output_ids) for r in res), wall_s=time.time() - t0)
    if method == "ar":
      ref = [r.output_ids for r in res]
    elif ref is not None:
      row["equal_to_ar"] = sum(r.output_ids == a for r, a in zip(res, ref))
    if method == "cure":
      gains = [s["repair_gain"] for r in res for s in r.stats]
      row["repair_won"] = int(sum(g > 0 for g in gains))
      row["repair_gain_tokens"] = int(sum(gains))
    out[name] = row
    print(f"measure {name}: {row}", flush=True)
  if m.out:
    pipeline.write_json(m.out, out)
  return out
