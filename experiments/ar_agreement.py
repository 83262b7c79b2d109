"""Our target-only greedy decoding vs transformers `generate`, token for token, on every prompt.

  python -m experiments.benchmark --table=1 --num_prompts=0 --results=results/full   # ours
  python -m experiments.ar_agreement --ours=results/full/raw/ar.json --results=results/full
  (the reference half can run first, alone: python -m experiments.ar_agreement --results=...)

Reads our outputs from a Table 1 run (`raw/ar.json`, same config and prompts), decodes the same
prompt ids with transformers (torch float32, greedy, same stop tokens and max_new_tokens) and,
where the two differ, reports the reference's own top-1 minus top-2 logit at the first
divergence: a near-tie there means float32 summation order decided the token, not a bug. The
reference outputs are cached in <results>/ar_reference.json, so a rerun only compares.
"""

import json
import time
from pathlib import Path

import numpy as np
from absl import flags

from cure_jax.runtime import errors, pipeline, prompts as prompts_lib
from cure_jax.analysis import report
from experiments.tables.bench import common_prefix

_CONFIG = errors.config_flag("configs/smollm2_135m.py",
                             "ml_collections config file (target, prompts)")
_OURS = flags.DEFINE_string("ours", None, "raw/ar.json of our Table 1 run; without it only the "
                            "reference outputs are generated and cached (first --num_prompts)")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 0, "without --ours: first N prompts (0 = all)")
_RESULTS = flags.DEFINE_string("results", "results", "output folder")
_THREADS = flags.DEFINE_integer("threads", 0, "torch threads (0: torch's default)")


def reference_outputs(path: str, prompts: list[list[int]], max_new: int, stops, cache: Path):
  """transformers greedy outputs and per-step top-1 minus top-2 logit gaps, cached in `cache`."""
  if cache.is_file():
    ref = json.loads(cache.read_text())
    if ref["prompts"] == prompts and ref["max_new_tokens"] == max_new:
      return ref
  import torch
  from tqdm import tqdm
  from transformers import AutoModelForCausalLM
  if _THREADS.value:
    torch.set_num_threads(_THREADS.value)
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


def main(argv):
  del argv
  config = _CONFIG.value
  ours_rows = json.loads(Path(_OURS.value).read_text()) if _OURS.value else None
  pipeline.resolve_paths(config)
  tokenizer = pipeline.load_tokenizer(config.target.path)
  rows = (prompts_lib.read_jsonl(config.prompts) if config.prompts
          else prompts_lib.humaneval_prompts())
  if ours_rows is None:
    index = list(range(min(_NUM_PROMPTS.value or len(rows), len(rows))))
  else:
    index = [r["prompt_index"] for r in ours_rows]
  if max(index) >= len(rows):
    raise ValueError(f"{_OURS.value} has prompt_index {max(index)} but the config's prompt set "
                     f"has {len(rows)} prompts; pass the --config used for that run")
  vocab = json.loads(Path(config.target.path, "config.json").read_text())["vocab_size"]
  ids = prompts_lib.encode([rows[i] for i in index], tokenizer, config.chat_template, vocab)
  max_new = int(config.max_new_tokens)
  ref = reference_outputs(config.target.path, ids, max_new,
                          pipeline.stop_ids(config.target.path, tokenizer),
                          Path(_RESULTS.value) / "ar_reference.json")
  if ours_rows is None:
    print(f"reference outputs for {len(ids)} prompts in {_RESULTS.value}/ar_reference.json")
    return
  result = compare([r["output_ids"] for r in ours_rows], ref)
  result.update(max_new_tokens=max_new, reference_seconds=ref["seconds"], ours=_OURS.value)
  pipeline.write_json(str(Path(_RESULTS.value) / "ar_agreement.json"), result)
  md = markdown(result, max_new)
  report.write_text(Path(_RESULTS.value) / "ar_agreement.md", md)
  print(md)


if __name__ == "__main__":
  errors.run(main)
