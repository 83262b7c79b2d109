"""Decode prompts with one method and report tokens, tau and speed.

  python -m experiments.decode --config=configs/qwen3_8b.py --config.method=cure \
    --config.target.path=DIR --config.drafter.path=DIR --config.prompts=FILE.jsonl \
    --config.output=OUT.json

On several hosts (`--config.mesh.distributed=true`, or rehearsed on one machine with
`python -m experiments.launch`), every process runs this same command; they check that they were
given the same config and prompts before decoding and hold the same results after; process 0
reports and writes the output.
"""

import json
from pathlib import Path

from cure_jax.runtime import distributed, errors, pipeline, prompts as prompts_lib
from cure_jax.costs import roofline

# Qwen3-8B + DFlash-b16 compiled for an H100 (experiments.aot; WORKSPACE.md,
# "2026-12-03 — GPU work in part")
GPU_COUNTS = Path(__file__).resolve().parents[1] / "results" / "aot_gpu" / "h100_b1.json"

WARMUP_CALLS = 4   # auto: untimed calls at most before the timed ones
_CONFIG = errors.config_flag("configs/smollm2_135m.py", "ml_collections config file")


def main(argv):
  del argv
  config = _CONFIG.value
  with distributed.job(config):
    run(config)


def _timed(generator, ids, config, batch_size: int):
  """Every batch decoded, after untimed decodes of the first one (config.warmup): one, and for
  auto more until its next call would run the target-only program, at most WARMUP_CALLS: the
  timed calls then show what a process that has decoded a few calls gets, not the looks at the
  drafter that the first calls take and the back-off then spaces out (controller.py)."""
  for _ in range(WARMUP_CALLS if config.warmup else 0):
    generator.generate(ids[:batch_size])
    if generator.auto is None or generator.next_spec(ids[:batch_size]).method == "ar":
      break
  return pipeline.decode_all(generator, ids, batch_size)


def run(config):
  pipeline.check_config(config)
  pipeline.enable_compilation_cache(config)
  pipeline.resolve_paths(config)
  target = pipeline.load_target(config)
  drafter = pipeline.load_drafter(config, target)
  tokenizer = pipeline.load_tokenizer(config.target.path)
  rows = (prompts_lib.read_jsonl(config.prompts) if config.prompts
          else prompts_lib.humaneval_prompts()[:1])
  if config.num_prompts:
    rows = rows[:config.num_prompts]
  ids = prompts_lib.encode(rows, tokenizer, config.chat_template, target.cfg.vocab_size)
  distributed.agree(dict(distributed.config_fields(config), prompts=ids), "configs or prompts")
  stops = pipeline.stop_ids(config.target.path, tokenizer)
  generator = pipeline.make_generator(config, target, drafter, stops)
  results = _timed(generator, ids, config, config.batch_size)
  summary = pipeline.summary(results)
  summary["compile_s"] = sum(generator.compile_s.values())
  if config.check_ar and (config.method != "ar" or config.numerics == "invariant"):
    # invariant numerics: the reference is target-only decoding one prompt at a time
    batch = 1 if config.numerics == "invariant" else config.batch_size
    reference = _timed(pipeline.make_generator(config, target, None, stops, "ar"), ids, config,
                       batch)
    summary["equal_to_ar"] = sum(r.output_ids == a.output_ids for r, a in zip(results, reference))
    summary["ar_tpot_ms"] = pipeline.summary(reference)["tpot_ms"]
  distributed.agree({"results": [r.output_ids for r in results]}, "results")
  projected = gpu_projection(config.method, summary["tau"], int(config.cure.v_max))
  if projected:
    summary["projected_h200_qwen3_8b"] = projected
  if not distributed.is_writer():  # every process holds the results; the first one reports
    return
  if config.output:
    pipeline.write_json(config.output, dict(config=config.to_dict(), summary=summary,
                                            results=pipeline.result_rows(results, tokenizer)))
    print(f"wrote {config.output}: {summary}")
    return
  for row in pipeline.result_rows(results, tokenizer):
    print(row["text"])
    print("-" * 40)
  print(" ".join(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}"
                 for k, v in summary.items() if k != "projected_h200_qwen3_8b"))
  if projected:
    print(f"projection, not a measurement: Qwen3-8B + DFlash-b16 on an H200 at this τ "
          f"({summary['tau']:.3f}), {config.method}: {projected['tpot_ms']:.2f} ms per token, "
          f"{projected['speedup']:.2f}x target-only (roofline of the compiled program's counts, "
          f"{GPU_COUNTS.relative_to(GPU_COUNTS.parents[2])})")


def gpu_projection(method: str, tau: float, v_max: int) -> dict | None:
  """TPOT and speedup over target-only that the committed GPU counts project for Qwen3-8B on
  an H200 at τ (batch 1), for a tree method at the config's v_max where it was compiled; None
  without counts for the method."""
  if not GPU_COUNTS.is_file():
    return None
  records = roofline.decode_records(json.loads(GPU_COUNTS.read_text()))
  rows = roofline.project(records, ["H200"], 1.0, {"measured": {"ar": 1.0, method: tau}},
                          launch_us=roofline.LAUNCH_US)
  rows = [r for r in rows if r["method"] == method and r["batch"] == 1]
  row = next((r for r in rows if r["v_max"] == v_max), rows[0] if rows else None)
  return None if row is None else dict(tpot_ms=row["tpot_ms"], speedup=row["speedup"],
                                       iteration_ms=row["iteration_ms"])


if __name__ == "__main__":
  errors.run(main)
