"""What a decoding step costs on the accelerator this runs on, with the real models' shapes and
random bf16 weights (random weights make τ meaningless; costs are what this measures).

  python -m experiments.device_costs --output_dir=results/device_h200        # GPU / TPU
  python -m experiments.device_costs --small --output_dir=/tmp/device_costs  # CPU check

Parts (--parts, run in this order; each writes <output_dir>/<part>.json as soon as it ends; no
part, batch, chunk or node count starts after --deadline_s seconds, so a lease's end loses
nothing measured):
  smoke    small random pairs (dense and MoE), float32: chain, ddtree, cure and auto give the
           greedy tokens of target-only decoding on this device, through its attention kernels
  curve    the goodput controller's cost curve C(B, n) (runtime/cost_curve.py) of Qwen3-8B +
           DFlash-b16 at each --batches: one drafter pass and the target over each budget
  prefill  a --prompt_len prefill of Qwen3-8B + DFlash at each --chunks (prefill_chunk): seconds
           and tokens/s, from which the platform's default chunk is chosen
  moe      Qwen3-Coder-30B-A3B's C_v(n) at batch 1 (experts gathered or grouped), to set beside
           the dense 8B's in `curve`
  steps    C_v(n), C_d and the compiled loops' ms per iteration of ar, chain and cure (8B)
  loops    the decode loops as experiments.decode runs them (Qwen3-8B + DFlash-b16, random bf16
           weights, so τ is meaningless and cost is what is measured): ms per iteration of ar,
           chain, ddtree at each --tree_nodes, cure and auto at each --loop_batches (batch 1
           first), beside the count of the same compiled program (costs/hlo_traffic: HBM bytes
           and FLOPs of one iteration) at this device's measured HBM bandwidth (a large copy)
           and bf16 GEMM peak; writes loops.json and loops.md
  (python -m experiments.device_costs --parts=loops --deadline_s=480 --output_dir=...)
  numerics numerics=invariant against the default mode (a Qwen3-8B-like pair scaled to 4
           layers of hidden 1,024, random bf16 weights: near-ties are common, a hard test):
           prompts that greedy ar, chain and ddtree at batch 8 (default mode: ar) decode other
           than target-only decoding of each prompt alone, and target-only ms per token at
           batch 1 and 8
  (python -m experiments.device_costs --parts=numerics --deadline_s=240 --output_dir=...)
  train    the Qwen3-8B online drafter training step (configs/train/qwen3_8b.py: frozen bf16
           target + float32 DFlash-b16 drafter and AdamW) at each --train_rows rows of
           --train_len tokens: seconds per step, tokens/s, and MFU at this device's own bf16
           peak, measured first by a large GEMM
  (python -m experiments.device_costs --parts=train --deadline_s=420 --output_dir=...)
"""

from __future__ import annotations

import time

_START = time.perf_counter()   # --deadline_s counts from here

from absl import flags

from configs.train import qwen3_8b
from cure_jax.analysis import device_costs
from cure_jax.runtime import errors

_PARTS = flags.DEFINE_list("parts", ["smoke", "curve", "prefill", "moe"],
                           "of smoke, curve, prefill, moe, steps, loops, numerics, train")
_OUTPUT_DIR = flags.DEFINE_string("output_dir", "", "one JSON per part here")
_DEADLINE = flags.DEFINE_float("deadline_s", 1e9, "start no new measurement after this many "
                                "seconds")
_SMALL = flags.DEFINE_bool("small", False, "scaled-down models (a CPU check of the script)")
_BATCHES = flags.DEFINE_list("batches", ["1", "8", "64"], "curve: batch sizes")
_BUDGETS = flags.DEFINE_list("budgets", ["1", "4", "8", "16"], "curve: node budgets")
_MAX_LEN = flags.DEFINE_integer("max_len", 4096, "curve / steps: the static cache length")
_PROMPT_LEN = flags.DEFINE_integer("prompt_len", 32768, "prefill: prompt tokens")
_CHUNKS = flags.DEFINE_list("chunks", ["512", "1024", "2048"], "prefill: chunk sizes")
_NODES = flags.DEFINE_list("nodes", ["1", "2", "4", "8", "16", "32", "64"], "moe: tree nodes")
_TARGET = flags.DEFINE_string("target", "configs/hf/qwen3_8b", "dense target's config.json dir")
_DRAFTER = flags.DEFINE_string("drafter", "configs/hf/qwen3_8b_dflash_b16", "DFlash's dir")
_MOE = flags.DEFINE_string("moe", "configs/hf/qwen3_coder_30b_a3b", "MoE target's dir")
_LOOP_BATCHES = flags.DEFINE_list("loop_batches", ["1", "8", "32"], "loops: batch sizes")
_TREE_NODES = flags.DEFINE_list("tree_nodes", ["16", "64", "256"], "loops: ddtree node budgets")
_LOOP_TOKENS = flags.DEFINE_integer("loop_tokens", 64, "loops: new tokens a row (iterations)")
_TRAIN_ROWS = flags.DEFINE_list("train_rows", ["4", "2"], "train: rows per step, tried in order "
                                "until one fits")
_TRAIN_LEN = flags.DEFINE_integer("train_len", 3072, "train: tokens per row")
_NUMERICS_TOKENS = flags.DEFINE_integer("numerics_tokens", 48, "numerics: new tokens a prompt")


def _ints(values) -> tuple[int, ...]:
  return tuple(int(v) for v in values)


def main(argv):
  del argv
  device_costs.run(_PARTS.value, device_costs.Settings(
      output_dir=_OUTPUT_DIR.value, small=_SMALL.value, batches=_ints(_BATCHES.value),
      budgets=_ints(_BUDGETS.value), max_len=_MAX_LEN.value, prompt_len=_PROMPT_LEN.value,
      chunks=_ints(_CHUNKS.value), nodes=_ints(_NODES.value), target=_TARGET.value,
      drafter=_DRAFTER.value, moe=_MOE.value, loop_batches=_ints(_LOOP_BATCHES.value),
      tree_nodes=_ints(_TREE_NODES.value), loop_tokens=_LOOP_TOKENS.value,
      train_rows=_ints(_TRAIN_ROWS.value), train_len=_TRAIN_LEN.value,
      numerics_tokens=_NUMERICS_TOKENS.value, train_config=qwen3_8b.get_config(),
      deadline_s=_DEADLINE.value, start=_START))


if __name__ == "__main__":
  errors.run(main)
