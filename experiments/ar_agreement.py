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
from pathlib import Path

from absl import flags

from cure_jax.analysis import report, agreement as reference
from cure_jax.runtime import errors, pipeline, prompts as prompts_lib

_CONFIG = errors.config_flag("configs/smollm2_135m.py",
                             "ml_collections config file (target, prompts)")
_OURS = flags.DEFINE_string("ours", None, "raw/ar.json of our Table 1 run; without it only the "
                            "reference outputs are generated and cached (first --num_prompts)")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 0, "without --ours: first N prompts (0 = all)")
_RESULTS = flags.DEFINE_string("results", "results", "output folder")
_THREADS = flags.DEFINE_integer("threads", 0, "torch threads (0: torch's default)")


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
  ref = reference.reference_outputs(config.target.path, ids, max_new,
                                    pipeline.stop_ids(config.target.path, tokenizer),
                                    Path(_RESULTS.value) / "ar_reference.json", _THREADS.value)
  if ours_rows is None:
    print(f"reference outputs for {len(ids)} prompts in {_RESULTS.value}/ar_reference.json")
    return
  result = reference.compare([r["output_ids"] for r in ours_rows], ref)
  result.update(max_new_tokens=max_new, reference_seconds=ref["seconds"], ours=_OURS.value)
  pipeline.write_json(str(Path(_RESULTS.value) / "ar_agreement.json"), result)
  md = reference.markdown(result, max_new)
  report.write_text(Path(_RESULTS.value) / "ar_agreement.md", md)
  print(md)


if __name__ == "__main__":
  errors.run(main)
