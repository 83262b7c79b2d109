"""The roofline behind the projections: per-device peak figures and the time of one decode
iteration from a compiled program's counts (the records of experiments.aot). Used by
experiments.projection (tables) and experiments.decode (one line beside its CPU figures).

Per iteration and chip, time = max(HBM bytes / HBM bandwidth, FLOPs / bf16 peak), plus, for
GPU compiles, the host launches times a launch cost. TPOT = iteration time / τ; speedup =
TPOT(ar) / TPOT(method).
"""

from __future__ import annotations

# Public peak figures per chip / GPU: (HBM GB/s, dense bf16 TFLOP/s, source).
DEVICES = {
    "v5e": (819, 197, "cloud.google.com/tpu/docs/v5e"),
    "v6e": (1640, 918, "cloud.google.com/tpu/docs/v6e"),
    "v5p": (2765, 459, "cloud.google.com/tpu/docs/v5p"),
    "A100": (2039, 312, "nvidia.com/en-us/data-center/a100 (SXM 80 GB)"),
    "H100": (3350, 989, "nvidia.com/en-us/data-center/h100 (SXM)"),
    "H200": (4800, 989, "nvidia.com/en-us/data-center/h200 (SXM)"),
    "B200": (8000, 2250, "nvidia.com/en-us/data-center/dgx-b200 (per GPU, dense)"),
}
GPUS = ("A100", "H100", "H200", "B200")
# Interconnect bytes a chip sends per second, one direction (GB/s, source): TPU ICI per chip,
# NVLink per GPU (half the bidirectional figure NVIDIA quotes).
INTERCONNECT = {
    "v5e": (200, "cloud.google.com/tpu/docs/v5e: 1,600 Gbps ICI per chip"),
    "v6e": (448, "cloud.google.com/tpu/docs/v6e: 3,584 Gbps ICI per chip"),
    "v5p": (600, "cloud.google.com/tpu/docs/v5p: 4,800 Gbps ICI per chip"),
    "A100": (300, "NVLink 3: 600 GB/s bidirectional"),
    "H100": (450, "NVLink 4: 900 GB/s bidirectional"),
    "H200": (450, "NVLink 4: 900 GB/s bidirectional"),
    "B200": (900, "NVLink 5: 1.8 TB/s bidirectional"),
}
LAUNCH_US = 4.0  # host cost of one launch (a kernel or a CUDA graph), µs: an assumption
# HumanEval, Qwen3-8B, greedy (the paper): τ and speedup over target AR.
PAPER_TAU = {"ar": 1.0, "chain": 7.165, "cure": 7.641}
PAPER_SPEEDUP = {"chain": 5.21, "cure": 3.49}   # DFlash as in the paper's peers table
# τ other systems publish for Qwen3-8B, greedy, to price measured loops with ("method" or
# "method/nodes"): DDTree's best-first trees on one DFlash pass; JetSpec's 256-node trees.
PUBLISHED_TAU = {"DDTree (MATH-500)": {"ddtree": 10.73},
                 "JetSpec (MATH-500, 256 nodes)": {"ddtree/256": 10.76}}
SHARES = {"weights": ("target_weights", "target_head"), "drafter": ("drafter_weights",),
          "kv": ("target_kv", "drafter_kv"), "tree and state": ("activation", "state", "input")}


def iteration_ms(bytes_: float, flops: float, device: str) -> float:
  bw, peak, _ = DEVICES[device.split(" ")[0]]
  return 1000 * max(bytes_ / (bw * 1e9), flops / (peak * 1e12))


def device_named(topology: str) -> str:
  """The DEVICES key of a topology name (v5e:4x4 -> v5e, h100:8 -> H100)."""
  gen = topology.split(":")[0]
  found = [k for k in DEVICES if k.lower() == gen.lower()]
  if not found:
    raise ValueError(f"no public figures for {topology!r}; known: {sorted(DEVICES)}")
  return found[0]


def step_seconds(flops: float, hbm_bytes: float, collective_bytes: float, device: str) -> dict:
  """A step's projected time per chip: the largest of its FLOPs at the bf16 peak, its HBM
  traffic at the bandwidth and the bytes it sends at the interconnect's bandwidth (each part
  alone is a floor; perfect overlap), and serial_s, their sum (no overlap at all)."""
  bw, peak, _ = DEVICES[device]
  parts = dict(flop_s=flops / (peak * 1e12), hbm_s=hbm_bytes / (bw * 1e9),
               collective_s=collective_bytes / (INTERCONNECT[device][0] * 1e9))
  return dict(parts, step_s=max(parts.values()), bound=max(parts, key=parts.get),
              serial_s=sum(parts.values()))


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


def weight_flops(rec: dict, block_size: int = 16) -> float:
  """2 x parameters x tokens of one iteration (bf16 weights: 2 bytes a parameter)."""
  w, nodes = rec["weights"], rec["v_max"] or (1 if rec["method"] == "ar" else block_size)
  drafter = 0.0 if rec["method"] == "ar" else w.get("drafter", 0.0) * block_size
  return rec["batch"] * (w["target"] * nodes + drafter)


def measured(loops: dict, taus: dict[str, dict[str, float]]) -> list[dict]:
  """Rows from the decode loops timed on a device (experiments.device_costs --parts=loops):
  per (method, nodes, batch, τ source), the measured ms per iteration, TPOT = ms / τ and the
  speedup over the measured target-only loop at that batch."""
  ok = [r for r in loops["records"] if "failed" not in r]
  ar = {r["batch"]: r["ms_per_iteration"] for r in ok if r["method"] == "ar"}
  rows = []
  for r in ok:
    for source, tau in taus.items():
      t = tau.get(f"{r['method']}/{r['nodes']}", tau.get(r["method"]))
      if t is None:
        continue
      tpot = r["ms_per_iteration"] / t
      rows.append(dict(device=f"{loops['device_kind']} (measured)", method=r["method"],
                       nodes=r["nodes"], batch=r["batch"], tau_from=source, tau=t,
                       iteration_ms=r["ms_per_iteration"], count_ms=r["count_ms"],
                       tpot_ms=tpot, speedup=ar[r["batch"]] / tpot if r["batch"] in ar else None))
  return rows


def launch_ms(rec: dict, launch_us: float) -> float:
  gpu = (rec.get("gpu_launches") or {}).get("iteration") or {}
  return gpu.get("launches", 0) * launch_us / 1000


def project(records: dict, devices, bytes_scale: float, taus: dict[str, dict[str, float]],
            launch_us: float = 0.0):
  """Rows: one per (device, method, v_max, batch, τ source)."""
  rows = []

  def ms_of(rec, device):
    flops = rec["xla_flops"] or (weight_flops(rec) if launch_us else 0.0)
    return (iteration_ms(rec["iteration"]["hbm_bytes"] * bytes_scale, flops, device) +
            launch_ms(rec, launch_us))

  for device in devices:
    for (method, v_max, batch), rec in sorted(records.items()):
      ar = records.get(("ar", 0, batch))
      ms = ms_of(rec, device)
      ar_ms = ms_of(ar, device) if ar else None
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
