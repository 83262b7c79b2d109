"""Projected decoding speed from the compiled programs' counts (experiments/aot.py output).

Per iteration and chip, time = max(HBM bytes / HBM bandwidth, FLOPs / bf16 peak): a roofline
from the count of the optimized HLO, not a measurement. TPU figures come from TPU compiles of
the sharded program (per chip). GPU figures come from GPU compiles (`--gpu`, XLA's GPU
compiler, bf16, per GPU) plus a launch term: the host launches per iteration (kernels outside
CUDA graphs, one per graph; cure_jax/costs/launches.py) times `--launch_us`. XLA's GPU compiler
gives no cost analysis, so their FLOPs are the weights' 2 x parameters x tokens per iteration
(target: batch x tree nodes; drafter: batch x block size). Without GPU compiles, `--cpu` takes
the CPU backend's float32 program with bytes halved for bf16. TPOT = iteration time / τ;
speedup = TPOT(ar) / TPOT(method).

  python -m experiments.projection --tpu=results/aot/v5e.json --gpu=results/aot_gpu/h100_b1.json \
    --output=results/aot/projection

--loops=results/device_<kind>/loops.json adds the decode loops as timed on that device
(experiments.device_costs --parts=loops) beside the counts: measured ms per iteration and the
speedups they imply at the paper's, DDTree's and JetSpec's published τ, labelled as such.
"""

from __future__ import annotations

from absl import app, flags

from cure_jax.analysis import projection, report
from cure_jax.costs import roofline
from cure_jax.costs.roofline import PAPER_TAU
from cure_jax.runtime import errors, pipeline

_TPU = flags.DEFINE_list("tpu", [], "aot JSON files of TPU compiles (per-chip counts)")
_CPU = flags.DEFINE_string("cpu", "", "aot JSON of a CPU-backend float32 compile (for GPUs)")
_GPU = flags.DEFINE_list("gpu", [], "aot JSON files of GPU compiles (--topology=h100 ...), "
                         "priced on every GPU of DEVICES")
_LAUNCH_US = flags.DEFINE_float("launch_us", roofline.LAUNCH_US, "host cost of one launch (a kernel or a CUDA "
                                "graph) in µs, for the GPU launch term")
_TAU = flags.DEFINE_string("tau", "", "measured τ as method=value,... (e.g. chain=2.005,"
                           "cure=2.431); the paper's τ is always shown")
_TAU_FROM = flags.DEFINE_string("tau_from", "measured", "where --tau's values come from, as the "
                                "table's 'τ from' column says it (e.g. 'DDTree paper, MoE')")
_OUTPUT = flags.DEFINE_string("output", "results/aot/projection", "output path, no extension")
_AUTO_BATCHES = flags.DEFINE_list("auto_batches", [], "batch sizes at which to project method=auto "
                                  "(needs --gpu files with ar and chain at two batch sizes)")
_AUTO_BUDGETS = flags.DEFINE_list("auto_budgets", ["1", "4", "8", "16"], "auto's node budgets")
_AUTO_TAU = flags.DEFINE_list("auto_tau", [str(PAPER_TAU["chain"])], "τ of a whole 16-token "
                              "block at which to project auto (default: the paper's chain τ)")
_AUTO_MEASURED = flags.DEFINE_list("auto_measured", [], "experiments.device_costs curve.json "
                                   "files: auto on cost curves timed on a device, beside the "
                                   "projection (a later file's batch replaces an earlier one's)")
_LOOPS = flags.DEFINE_list("loops", [], "loops.json files of experiments.device_costs: decode "
                           "loops timed on a device")
_ALSO = flags.DEFINE_list("also_as", [], "TPU generations without a compile of their own (e.g. "
                          "v6e,v5p) priced with the per-chip counts of the --tpu files (rows "
                          "marked 'counts of <topology>')")


def main(argv):
  del argv
  if not (_TPU.value or _CPU.value or _GPU.value or _AUTO_MEASURED.value or _LOOPS.value):
    raise app.UsageError("give --tpu=FILE.json (TPU compiles), --gpu=FILE.json (GPU compiles), "
                         "--cpu=FILE.json (CPU float32) and/or --loops=FILE.json (timed loops)")
  taus = {"paper": PAPER_TAU}
  if _TAU.value:
    taus[_TAU_FROM.value] = projection.parse_tau(_TAU.value)
  rows = projection.compiled_rows(_TPU.value, _GPU.value, _CPU.value, _ALSO.value, taus,
                                  _LAUNCH_US.value)
  budgets, block_taus = [int(b) for b in _AUTO_BUDGETS.value], [float(t) for t in _AUTO_TAU.value]
  auto = (projection.measured_auto(_AUTO_MEASURED.value, budgets, block_taus) +
          projection.auto_projection(_GPU.value, [int(b) for b in _AUTO_BATCHES.value], budgets,
                                     block_taus, _LAUNCH_US.value))
  loops = [row for path in _LOOPS.value
           for row in roofline.measured(projection.load(path),
                                        {**taus, **roofline.PUBLISHED_TAU})]
  pipeline.write_json(_OUTPUT.value + ".json", dict(devices=roofline.DEVICES, rows=rows,
                                                    auto=auto, measured=loops))
  text = ((projection.markdown(rows) if rows else "") + projection.auto_markdown(auto) +
          projection.measured_markdown(loops))
  report.write_text(_OUTPUT.value + ".md", text)
  print(text)


if __name__ == "__main__":
  errors.run(main)
