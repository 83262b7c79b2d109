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

import json

from absl import app, flags

from cure_jax import methods
from cure_jax.runtime import errors, pipeline
from cure_jax.costs import curve, roofline
from cure_jax.analysis import report
from cure_jax.costs.roofline import (DEVICES, GPUS, PAPER_TAU, SHARES, decode_records, device_of,
                                  project)

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

def markdown(rows: list[dict]) -> str:
  table = [[r["device"], r["method"] + (f" v{r['v_max']}" if r["v_max"] else ""),
            r["batch"], r["tau_from"], f"{r['tau']:.3f}", f"{r['iteration_ms']:.2f}",
            f"{r['tpot_ms']:.3f}", report.num(r["speedup"], ".2f", "x"),
            report.num(r["paper_speedup"], ".2f", "x"),
            " / ".join(f"{100 * r[k]:.0f}%" for k in SHARES)] for r in rows]
  sources = "; ".join(f"{k}: {bw} GB/s, {pk} TFLOP/s ({src})" for k, (bw, pk, src)
                      in DEVICES.items())
  return ("# Projected speed from the compiled programs' counts\n\n" + report.md_table(
      ["device", "method", "batch", "τ from", "τ", "iteration ms", "TPOT ms", "speedup vs ar",
       "paper speedup", "weights / drafter / KV / tree+state"], table) +
      f"\n\nPeak figures: {sources}. Time per iteration = max(bytes / bandwidth, FLOPs / peak) "
      "per chip, plus on GPUs compiled as such the launches times the launch cost; TPOT = "
      "iteration / τ (τ counts the bonus token).\n")


def measured_markdown(rows: list[dict]) -> str:
  if not rows:
    return ""
  table = [[r["device"], r["method"] + (f" {r['nodes']}" if r["method"] not in ("ar",) else ""),
            r["batch"], r["tau_from"], f"{r['tau']:.3f}", f"{r['iteration_ms']:.2f}",
            f"{r['count_ms']:.2f}", f"{r['tpot_ms']:.3f}", report.num(r["speedup"], ".2f", "x")]
           for r in rows]
  return ("\n## Measured on a device (experiments.device_costs --parts=loops)\n\n" +
          report.md_table(["device", "method, nodes", "batch", "τ from", "τ",
                           "measured ms / iteration", "count ms", "TPOT ms", "speedup vs ar"],
                          table) +
          "\n\nms per iteration timed on the device with random weights (τ there is meaningless);"
          " TPOT = that / τ at each source's published τ; the count is the same program's bytes "
          "and FLOPs at the device's measured bandwidth and peak.\n")


def parse_tau(text: str) -> dict[str, float]:
  out = {"ar": 1.0}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, value = part.partition("=")
    if name not in methods.names() or not value:
      raise ValueError(f"--tau: {part!r} is not method=value with method in "
                       f"{sorted(methods.names())}")
    out[name] = float(value)
  return out


def auto_projection(gpu_data: list[dict]) -> list[dict]:
  """method=auto's budget and tokens/s per batch size on each GPU, on the cost curve of the
  compiled ar and chain programs (cure_jax/costs/curve.py), at the paper's chain τ."""
  rows = measured_auto()
  if not _AUTO_BATCHES.value:
    return rows
  records = {k: r for data in gpu_data for k, r in decode_records(data).items()}
  pairs = {m: sorted((r for (mm, v, _), r in records.items() if mm == m and not v),
                     key=lambda r: r["batch"])[:2] for m in ("ar", "chain")}
  if any(len(p) < 2 for p in pairs.values()):
    raise app.UsageError("--auto_batches needs --gpu files holding ar and chain decode programs at "
                         "two batch sizes (e.g. results/aot_gpu/h100_b1.json,h100_b8.json)")
  budgets = [int(b) for b in _AUTO_BUDGETS.value]
  return rows + [row for tau in _AUTO_TAU.value for device in ("H100", "H200")
                 for row in curve.auto_rows(tuple(pairs["ar"]), tuple(pairs["chain"]), device,
                                            [int(b) for b in _AUTO_BATCHES.value], budgets,
                                            float(tau), 16, _LAUNCH_US.value)]


def measured_auto() -> list[dict]:
  """auto's pick on the --auto_measured curves, at each --auto_tau."""
  if not _AUTO_MEASURED.value:
    return []
  latest, kind = {}, None
  for path in _AUTO_MEASURED.value:
    data = json.loads(open(path).read())
    kind = data["device_kind"]
    latest.update({r["batch"]: r for r in data["rows"]})
  ms = curve.measured_ms(list(latest.values()))
  return [row for tau in _AUTO_TAU.value
          for row in curve.choose(ms, f"{kind} (measured)", sorted(latest),
                                  [int(b) for b in _AUTO_BUDGETS.value], float(tau), 16)]


def auto_markdown(rows: list[dict]) -> str:
  if not rows:
    return ""
  budgets = [o["budget"] for o in rows[0]["options"]]
  table = [[r["device"], f"{r['block_tau']:.3g}", r["batch"], r["auto_budget"],
            f"{r['auto_tokens_per_s']:.0f}",
            report.num(r["auto_vs_ar"], ".2f", "x")] +
           [f"{o['tokens_per_s']:.0f}" for o in r["options"]] for r in rows]
  return ("\n## method=auto on the cost curve: projected from the compiled programs' counts, or "
          "timed on a device ('(measured)' rows, experiments.device_costs)\n\n" +
          report.md_table(["device", "block τ", "batch", "auto picks", "auto tokens/s", "vs ar"] +
                          [f"budget {n} tokens/s" for n in budgets], table) +
          f"\n\nBudget 1 is a plain target step (the ar program); budget n > 1 verifies the first n "
          f"nodes of the chain program's block, τ(n) from a per-depth acceptance fitted to the "
          f"block's τ (the paper's chain τ is {PAPER_TAU['chain']}; cure_jax/costs/curve.py). Bytes are linear in "
          "the batch through the two compiled batch sizes.\n")


def main(argv):
  del argv
  if not (_TPU.value or _CPU.value or _GPU.value or _AUTO_MEASURED.value or _LOOPS.value):
    raise app.UsageError("give --tpu=FILE.json (TPU compiles), --gpu=FILE.json (GPU compiles), "
                         "--cpu=FILE.json (CPU float32) and/or --loops=FILE.json (timed loops)")
  taus = {"paper": PAPER_TAU}
  if _TAU.value:
    taus[_TAU_FROM.value] = parse_tau(_TAU.value)
  rows = []
  for path in _TPU.value:
    data = json.loads(open(path).read())
    rows += project(decode_records(data), [device_of(data["meta"])], 1.0, taus)
    for gen in _ALSO.value:
      if gen not in DEVICES or gen in GPUS:
        raise app.UsageError(f"--also_as={gen}: choose TPU generations from "
                             f"{sorted(k for k in DEVICES if k not in GPUS)}")
      extra = project(decode_records(data), [gen], 1.0, taus)
      rows += [dict(r, device=f"{gen} (counts of {data['meta']['topology']})") for r in extra]
  for path in _GPU.value:
    data = json.loads(open(path).read())
    compiled = data["meta"]["device_kind"]
    extra = project(decode_records(data), GPUS, 1.0, taus, _LAUNCH_US.value)
    rows += [dict(r, device=f"{r['device']} (counts of {compiled})") for r in extra]
  if _CPU.value:
    data = json.loads(open(_CPU.value).read())
    if data["meta"]["dtype"] != "float32":
      raise app.UsageError(f"{_CPU.value} was compiled in {data['meta']['dtype']}; GPU figures "
                           "need the CPU backend's float32 program (--config.dtype=float32)")
    rows += project(decode_records(data), GPUS, 0.5, taus)
  auto = auto_projection([json.loads(open(p).read()) for p in _GPU.value])
  loops = [row for path in _LOOPS.value
           for row in roofline.measured(json.loads(open(path).read()),
                                        {**taus, **roofline.PUBLISHED_TAU})]
  pipeline.write_json(_OUTPUT.value + ".json", dict(devices=DEVICES, rows=rows, auto=auto,
                                                    measured=loops))
  text = (markdown(rows) if rows else "") + auto_markdown(auto) + measured_markdown(loops)
  report.write_text(_OUTPUT.value + ".md", text)
  print(text)


if __name__ == "__main__":
  errors.run(main)
