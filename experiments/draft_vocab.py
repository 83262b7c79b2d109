"""The reduced draft vocabulary (drafter.vocab): its token counts, and what it saves and costs.

  python -m experiments.draft_vocab --stage=counts \
      --responses=data/drafter_responses/smollm2_v2.npz \
      --output=cure_jax/assets/smollm2_dflash/token_counts.npz
  python -m experiments.draft_vocab --stage=measure --output=results/draft_vocab/smollm2.json
  python -m experiments.draft_vocab --stage=project \
      --aot=$(ls results/draft_vocab/qwen3_8b/*.json | paste -sd, -) \
      --output=results/draft_vocab/qwen3_8b_projection.json

counts: how often the target wrote each token in the responses its drafter was trained on
(prompts skipped), the file drafter.vocab ranks tokens by (default --output: token_counts.npz
beside config.drafter.path). measure: on the config's pair (default: the embedded SmolLM2 +
DFlash, float32, CPU), one drafter pass's cost C_d and τ of chain and ddtree on HumanEval 0-7
(held out of the drafter's training prompts) for each --sizes, beside target-only ar; writes
<output> and its .md atomically, and fails if any output differs from ar's. project: chain's
iteration time and TPOT per draft vocabulary from GPU compiles (experiments.aot, one file per
topology and drafter.vocab, --synthetic_vocab where the target has no counts), priced as
experiments.projection prices them, at the paper's chain τ for every N (a smaller N mostly
lowers τ: the table gives the τ at which it stops paying).
"""

import json
from pathlib import Path

from absl import flags

from cure_jax.checkpoints.store import read_hf_config
from cure_jax.analysis import report
from cure_jax.costs import roofline
from cure_jax.runtime import draft_vocab, errors, pipeline
from experiments.tables import bench as bench_lib
from experiments.tables.draft_vocab import SIZES, table_draft_vocab

_CONFIG = errors.config_flag("configs/smollm2_135m.py", "ml_collections config file")
_STAGE = flags.DEFINE_enum("stage", "measure", ["counts", "measure", "project"], "what to do")
_RESPONSES = flags.DEFINE_string("responses", "data/drafter_responses/smollm2_v2.npz",
                                 "counts: the drafter's training responses (tokens, lengths, "
                                 "prompt_lens)")
_OUTPUT = flags.DEFINE_string("output", "", "counts: the .npz to write (default: "
                              "token_counts.npz beside the drafter); measure: the .json to "
                              "write (default results/draft_vocab/smollm2.json)")
_SIZES = flags.DEFINE_multi_integer("sizes", list(SIZES), "measure: draft vocabularies (0: all)")
_NUM_PROMPTS = flags.DEFINE_integer("num_prompts", 8, "measure: HumanEval 0..N-1")
_AOT = flags.DEFINE_list("aot", [], "project: experiments.aot JSON files of GPU compiles (ar and "
                         "chain decode programs; one drafter.vocab each)")


def counts(config) -> None:
  pipeline.resolve_paths(config)
  vocab_size = int(read_hf_config(config.target.path)["vocab_size"])
  output = _OUTPUT.value or str(Path(config.drafter.path) / draft_vocab.COUNTS_FILE)
  tally = draft_vocab.count_tokens(_RESPONSES.value, vocab_size)
  draft_vocab.write_counts(output, tally)
  print(f"{output}: {int(tally.sum())} response tokens, {int((tally > 0).sum())} distinct of "
        f"{vocab_size}")


def measure(config) -> None:
  output = Path(_OUTPUT.value or "results/draft_vocab/smollm2.json")
  with config.unlocked():
    config.num_prompts = _NUM_PROMPTS.value
  bench = bench_lib.from_config(config, results_dir=str(output.parent), progress=False)
  payload = table_draft_vocab(bench, tuple(_SIZES.value), name=output.stem)
  if not payload["all_equal_to_ar"]:
    raise SystemExit(f"outputs differ from target-only ar: see {output}")


def project(config) -> None:
  del config
  if not _AOT.value or not _OUTPUT.value:
    raise SystemExit("--stage=project needs --aot=FILE.json,... and --output=FILE.json")
  tau = roofline.PAPER_TAU["chain"]
  taus = {"paper": {"ar": 1.0, "chain": tau}}
  found = {}   # (device, batch, method, N) -> (record, projected row)
  for path in _AOT.value:
    data = json.loads(Path(path).read_text())
    device = data["meta"]["topology"].split(":")[0].upper()
    if device not in roofline.GPUS:
      raise SystemExit(f"{path}: compiled for {data['meta']['topology']}; project reads GPU "
                       f"compiles ({', '.join(roofline.GPUS)})")
    records = roofline.decode_records(data)
    n = int(data["meta"].get("draft_vocab") or 0)
    for row in roofline.project(records, [device], 1.0, taus, roofline.LAUNCH_US):
      rec = records[(row["method"], row["v_max"], row["batch"])]
      found[(device, row["batch"], row["method"], n if row["method"] != "ar" else 0)] = (rec, row)
  rows = []
  for (device, batch, method, n), (rec, row) in sorted(   # the whole head first, then N down
      found.items(), key=lambda kv: kv[0][:3] + (-(kv[0][3] or float("inf")),)):
    if method != "chain":
      continue
    full = found.get((device, batch, "chain", 0))
    ar = found.get((device, batch, "ar", 0))
    w = rec["weights"]
    rows.append(dict(device=device, batch=batch, vocab=n,
                     draft_head_bytes=w.get("draft_head", w["lm_head"]),
                     hbm_bytes=rec["iteration"]["hbm_bytes"], iteration_ms=row["iteration_ms"],
                     tau=tau, tpot_ms=row["tpot_ms"],
                     vs_full=full[1]["tpot_ms"] / row["tpot_ms"] if full else None,
                     vs_ar=ar[1]["iteration_ms"] / row["tpot_ms"] if ar else None,
                     break_even_tau=tau * row["iteration_ms"] / full[1]["iteration_ms"]
                     if full else None))
  sources = {p: json.loads(Path(p).read_text())["meta"].get("draft_vocab_ids", "all")
             for p in _AOT.value}
  output = Path(_OUTPUT.value)
  pipeline.write_json(str(output), dict(rows=rows, aot=sources, tau=tau,
                                        launch_us=roofline.LAUNCH_US))
  table = [[r["device"], r["batch"], f"{r['vocab']:,}" if r["vocab"] else "full",
            f"{r['draft_head_bytes'] / 1e9:.3f}", f"{r['hbm_bytes'] / 1e9:.2f}",
            f"{r['iteration_ms']:.2f}", f"{r['tpot_ms']:.3f}", report.num(r["vs_full"], ".3f", "x"),
            report.num(r["vs_ar"], ".2f", "x"), report.num(r["break_even_tau"], ".3f")]
           for r in rows]
  md = ("## Reduced draft vocabulary on Qwen3-8B: chain, projected from GPU compiles\n\n" +
        report.md_table(["device", "batch", "N", "draft head GB", "HBM GB / iteration",
                         "iteration ms", f"TPOT ms at τ {tau}", "vs full head", "vs ar",
                         "τ at which N stops paying"], table) +
        "\n\nPer iteration: HBM bytes of the compiled decode loop's body (cure_jax/costs/"
        "hlo_traffic.py); time = max(bytes / bandwidth, FLOPs / peak) + launches x "
        f"{roofline.LAUNCH_US} µs (experiments/projection.py's rule). τ: the paper's chain τ "
        "for every N, which a reduced vocabulary mostly lowers; the last column is the τ at "
        "which N gives the full head's TPOT. The ids of a reduced N are synthetic (seeded random, "
        "experiments.aot --synthetic_vocab): the bytes depend on N, not on which rows.\n")
  report.write_text(str(output.with_suffix(".md")), md)
  print(md)


def main(argv):
  del argv
  {"counts": counts, "measure": measure, "project": project}[_STAGE.value](_CONFIG.value)


if __name__ == "__main__":
  errors.run(main)
