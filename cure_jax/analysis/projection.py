"""Projected decoding speed from the compiled programs' counts (experiments.aot reports), and
the decode loops timed on a device beside them (experiments.projection's tables).

Per iteration and chip, time = max(HBM bytes / HBM bandwidth, FLOPs / bf16 peak): a roofline
from the count of the optimized HLO (cure_jax/costs/roofline.py), not a measurement; TPOT =
iteration time / τ; speedup = TPOT(ar) / TPOT(method).
"""

from __future__ import annotations

import json

from cure_jax import methods
from cure_jax.analysis import report
from cure_jax.costs import curve
from cure_jax.costs.roofline import (DEVICES, GPUS, LAUNCH_US, PAPER_TAU, SHARES, decode_records,
                                     device_of, project)


def load(path: str) -> dict:
  """A JSON report (experiments.aot's, or device_costs' curve / loops)."""
  return json.loads(open(path).read())


def compiled_rows(tpu: list[str], gpu: list[str], cpu: str, also_as: list[str],
                  taus: dict[str, dict[str, float]], launch_us: float) -> list[dict]:
  """Projected rows of the aot reports at these paths: TPU compiles on their own chip (and on
  each TPU generation of also_as, with the same per-chip counts), GPU compiles on every GPU of
  DEVICES (plus the launch term), a CPU float32 compile on every GPU with its bytes halved for
  bf16."""
  rows = []
  for data in map(load, tpu):
    rows += project(decode_records(data), [device_of(data["meta"])], 1.0, taus)
    for gen in also_as:
      if gen not in DEVICES or gen in GPUS:
        raise ValueError(f"--also_as={gen}: choose TPU generations from "
                         f"{sorted(k for k in DEVICES if k not in GPUS)}")
      extra = project(decode_records(data), [gen], 1.0, taus)
      rows += [dict(r, device=f"{gen} (counts of {data['meta']['topology']})") for r in extra]
  for data in map(load, gpu):
    compiled = data["meta"]["device_kind"]
    extra = project(decode_records(data), GPUS, 1.0, taus, launch_us)
    rows += [dict(r, device=f"{r['device']} (counts of {compiled})") for r in extra]
  if cpu:
    data = load(cpu)
    if data["meta"]["dtype"] != "float32":
      raise ValueError(f"{cpu} was compiled in {data['meta']['dtype']}; GPU figures need the "
                       "CPU backend's float32 program (--config.dtype=float32)")
    rows += project(decode_records(data), GPUS, 0.5, taus)
  return rows


def markdown(rows: list[dict]) -> str:
  """The projected rows as a table, with the peak figures they were priced at."""
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
  """The decode loops timed on a device, priced at each published τ."""
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
  """--tau's method=value,... as {method: τ}, ar's 1.0 included."""
  out = {"ar": 1.0}
  for part in filter(None, (p.strip() for p in text.split(","))):
    name, _, value = part.partition("=")
    if name not in methods.names() or not value:
      raise ValueError(f"--tau: {part!r} is not method=value with method in "
                       f"{sorted(methods.names())}")
    out[name] = float(value)
  return out


def auto_projection(gpu: list[str], batches: list[int], budgets: list[int],
                    block_taus: list[float], launch_us: float) -> list[dict]:
  """method=auto's budget and tokens/s per batch size on each GPU, on the cost curve of the
  compiled ar and chain programs of the `gpu` reports (cure_jax/costs/curve.py), at each
  block τ (16 tokens)."""
  if not batches:
    return []
  records = {k: r for data in map(load, gpu) for k, r in decode_records(data).items()}
  pairs = {m: sorted((r for (mm, v, _), r in records.items() if mm == m and not v),
                     key=lambda r: r["batch"])[:2] for m in ("ar", "chain")}
  if any(len(p) < 2 for p in pairs.values()):
    raise ValueError("--auto_batches needs --gpu files holding ar and chain decode programs at "
                     "two batch sizes (e.g. results/aot_gpu/h100_b1.json,h100_b8.json)")
  return [row for tau in block_taus for device in ("H100", "H200")
          for row in curve.auto_rows(tuple(pairs["ar"]), tuple(pairs["chain"]), device,
                                     batches, budgets, tau, 16, launch_us)]


def measured_auto(paths: list[str], budgets: list[int], block_taus: list[float]) -> list[dict]:
  """auto's pick on the cost curves timed on a device (experiments.device_costs curve.json
  files; a later file's batch replaces an earlier one's), at each block τ."""
  if not paths:
    return []
  latest, kind = {}, None
  for data in map(load, paths):
    kind = data["device_kind"]
    latest.update({r["batch"]: r for r in data["rows"]})
  ms = curve.measured_ms(list(latest.values()))
  return [row for tau in block_taus
          for row in curve.choose(ms, f"{kind} (measured)", sorted(latest), budgets, tau, 16)]


def auto_markdown(rows: list[dict]) -> str:
  """method=auto's picks per device, block τ and batch."""
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


def draft_vocab_rows(paths: list[str]) -> list[dict]:
  """chain per draft vocabulary N from GPU compiles (one aot report per topology and
  drafter.vocab): iteration time and TPOT at the paper's chain τ for every N, against the full
  head and ar, and the τ at which N stops paying; the whole head first, then N down."""
  tau = PAPER_TAU["chain"]
  taus = {"paper": {"ar": 1.0, "chain": tau}}
  found = {}   # (device, batch, method, N) -> (record, projected row)
  for path in paths:
    data = load(path)
    device = data["meta"]["topology"].split(":")[0].upper()
    if device not in GPUS:
      raise ValueError(f"{path}: compiled for {data['meta']['topology']}; project reads GPU "
                       f"compiles ({', '.join(GPUS)})")
    records = decode_records(data)
    n = int(data["meta"].get("draft_vocab") or 0)
    for row in project(records, [device], 1.0, taus, LAUNCH_US):
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
  return rows


def draft_vocab_markdown(rows: list[dict]) -> str:
  """draft_vocab_rows as a table, with the rule they were priced by."""
  tau = PAPER_TAU["chain"]
  table = [[r["device"], r["batch"], f"{r['vocab']:,}" if r["vocab"] else "full",
            f"{r['draft_head_bytes'] / 1e9:.3f}", f"{r['hbm_bytes'] / 1e9:.2f}",
            f"{r['iteration_ms']:.2f}", f"{r['tpot_ms']:.3f}", report.num(r["vs_full"], ".3f", "x"),
            report.num(r["vs_ar"], ".2f", "x"), report.num(r["break_even_tau"], ".3f")]
           for r in rows]
  return ("## Reduced draft vocabulary on Qwen3-8B: chain, projected from GPU compiles\n\n" +
          report.md_table(["device", "batch", "N", "draft head GB", "HBM GB / iteration",
                           "iteration ms", f"TPOT ms at τ {tau}", "vs full head", "vs ar",
                           "τ at which N stops paying"], table) +
          "\n\nPer iteration: HBM bytes of the compiled decode loop's body (cure_jax/costs/"
          "hlo_traffic.py); time = max(bytes / bandwidth, FLOPs / peak) + launches x "
          f"{LAUNCH_US} µs (experiments/projection.py's rule). τ: the paper's chain τ "
          "for every N, which a reduced vocabulary mostly lowers; the last column is the τ at "
          "which N gives the full head's TPOT. The ids of a reduced N are synthetic (seeded "
          "random, experiments.aot --synthetic_vocab): the bytes depend on N, not on which "
          "rows.\n")
