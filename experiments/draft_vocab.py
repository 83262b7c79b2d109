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

from pathlib import Path

from absl import flags

from cure_jax.checkpoints.store import read_hf_config
from cure_jax.analysis import projection, report
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
    raise ValueError("--stage=project needs --aot=FILE.json,... and --output=FILE.json")
  rows = projection.draft_vocab_rows(_AOT.value)
  sources = {p: projection.load(p)["meta"].get("draft_vocab_ids", "all") for p in _AOT.value}
  output = Path(_OUTPUT.value)
  pipeline.write_json(str(output), dict(rows=rows, aot=sources, tau=roofline.PAPER_TAU["chain"],
                                        launch_us=roofline.LAUNCH_US))
  md = projection.draft_vocab_markdown(rows)
  report.write_text(str(output.with_suffix(".md")), md)
  print(md)


def main(argv):
  del argv
  {"counts": counts, "measure": measure, "project": project}[_STAGE.value](_CONFIG.value)


if __name__ == "__main__":
  errors.run(main)
