"""Projected decoding speed from the compiled programs' counts (experiments/aot.py output).

Per iteration and chip, time = max(HBM bytes / HBM bandwidth, FLOPs / bf16 peak): a roofline
from the count of the optimized HLO, not a measurement. TPU figures come from TPU compiles of
the sharded program (per chip); GPU figures from the CPU backend's float32 program (one device,
the whole model) with bytes halved for bf16 (the CPU backend upcasts bf16, so its bf16 program
cannot be counted). TPOT = iteration time / τ; speedup = TPOT(ar) / TPOT(method).

  python -m experiments.projection --tpu=results/aot/v5e.json --cpu=results/aot/cpu_f32.json \
    --output=results/aot/projection
"""

from __future__ import annotations

import json

from absl import app, flags

from cure_jax.runtime import errors, pipeline
from experiments import report

_TPU = flags.DEFINE_list("tpu", [], "aot JSON files of TPU compiles (per-chip counts)")
_CPU = flags.DEFINE_string("cpu", "", "aot JSON of a CPU-backend float32 compile (for GPUs)")
_TAU = flags.DEFINE_string("tau", "", "measured τ as method=value,... (e.g. chain=2.005,"
                           "cure=2.431); the paper's τ is always shown")
_OUTPUT = flags.DEFINE_string("output", "results/aot/projection", "output path, no extension")
_ALSO = flags.DEFINE_list("also_as", [], "TPU generations without a compile of their own (e.g. "
                          "v6e,v5p) priced with the per-chip counts of the --tpu files (rows "
                          "marked 'counts of <topology>')")

# Public peak figures per chip / GPU: (HBM GB/s, dense bf16 TFLOP/s, source).
DEVICES = {
    "v5e": (819, 197, "cloud.google.com/tpu/docs/v5e"),
    "v6e": (1640, 918, "cloud.google.com/tpu/docs/v6e"),
    "v5p": (2765, 459, "cloud.google.com/tpu/docs/v5p"),
    "H100": (3350, 989, "nvidia.com/en-us/data-center/h100 (SXM)"),
    "H200": (4800, 989, "nvidia.com/en-us/data-center/h200 (SXM)"),
    "B200": (8000, 2250, "nvidia.com/en-us/data-center/dgx-b200 (per GPU, dense)"),
}
GPUS = ("H100", "H200", "B200")
# HumanEval, Qwen3-8B, greedy (the paper): τ and speedup over target AR.
PAPER_TAU = {"ar": 1.0, "chain": 7.165, "cure": 7.641}
PAPER_SPEEDUP = {"chain": 5.21, "cure": 3.49}   # DFlash as reported by the paper's peers table
SHARES = {"weights": ("target_weights", "target_head"), "drafter": ("drafter_weights",),
          "kv": ("target_kv", "drafter_kv"), "tree and state": ("activation", "state", "input")}


def iteration_ms(bytes_: float, flops: float, device: str) -> float:
  bw, peak, _ = DEVICES[device.split(" ")[0]]
  return 1000 * max(bytes_ / (bw * 1e9), flops / (peak * 1e12))


def device_of(meta: dict) -> str:
  gen = meta["topology"].split(":")[0]
  if gen not in DEVICES:
    raise ValueError(f"no public figures for topology {meta['topology']!r}; known: "
                     f"{sorted(k for k in DEVICES if k not in GPUS)}")
  return gen


def decode_records(data: dict) -> dict[tuple[str, int, int], dict]:
  return {(r["method"], r["v_max"], r["batch"]): r for r in data["records"]
          if r["program"] == "decode"}


def shares(rec: dict) -> dict[str, float]:
  labels = rec["iteration"]["by_label"]
  total = sum(labels.values()) or 1.0
  return {k: sum(labels.get(x, 0.0) for x in v) / total for k, v in SHARES.items()}


def project(records: dict, devices, bytes_scale: float, taus: dict[str, dict[str, float]]):
  """Rows: one per (device, method, v_max, batch, τ source)."""
  rows = []
  for device in devices:
    for (method, v_max, batch), rec in sorted(records.items()):
      ar = records.get(("ar", 0, batch))
      ms = iteration_ms(rec["iteration"]["hbm_bytes"] * bytes_scale, rec["xla_flops"], device)
      ar_ms = iteration_ms(ar["iteration"]["hbm_bytes"] * bytes_scale, ar["xla_flops"],
                           device) if ar else None
      for source, tau in taus.items():
        t = tau.get(method)
        if t is None:
          continue
        tpot = ms / t
        rows.append(dict(device=device, method=method, v_max=v_max, batch=batch, tau_from=source,
                         tau=t, iteration_ms=ms, tpot_ms=tpot,
                         speedup=(ar_ms / tpot) if ar_ms else None,
                         paper_speedup=PAPER_SPEEDUP.get(method), **shares(rec)))
  return rows


def markdown(rows: list[dict]) -> str:
  table = [[r["device"], r["method"] + (f" v{r['v_max']}" if r["method"] == "cure" else ""),
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
      "per chip; TPOT = iteration / τ (τ counts the bonus token).\n")


def parse_tau(text: str) -> dict[str, float]:
  out = {"ar": 1.0}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, value = part.partition("=")
    if name not in PAPER_TAU or not value:
      raise ValueError(f"--tau: {part!r} is not method=value with method in {sorted(PAPER_TAU)}")
    out[name] = float(value)
  return out


def main(argv):
  del argv
  if not _TPU.value and not _CPU.value:
    raise app.UsageError("give --tpu=FILE.json (TPU compiles) and/or --cpu=FILE.json (CPU float32)")
  taus = {"paper": PAPER_TAU}
  if _TAU.value:
    taus["measured"] = parse_tau(_TAU.value)
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
  if _CPU.value:
    data = json.loads(open(_CPU.value).read())
    if data["meta"]["dtype"] != "float32":
      raise app.UsageError(f"{_CPU.value} was compiled in {data['meta']['dtype']}; GPU figures "
                           "need the CPU backend's float32 program (--config.dtype=float32)")
    rows += project(decode_records(data), GPUS, 0.5, taus)
  pipeline.write_json(_OUTPUT.value + ".json", dict(devices=DEVICES, rows=rows))
  text = markdown(rows)
  report.write_text(_OUTPUT.value + ".md", text)
  print(text)


if __name__ == "__main__":
  app.run(errors.cli(main))
