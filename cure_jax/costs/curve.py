"""The cost curve C(B, n) for hardware we lack, from compiled programs' counts, and the budget
the goodput controller (cure_jax/tree/controller.py) would pick on it.

A decode iteration's HBM bytes at batch B come from the compiled ar and chain programs at two
batch sizes (experiments.aot records), linear in B between and beyond them (weights once, KV
and activations per row: the counts at batch 1 and 8 fix both terms). FLOPs are the weights'
2 × parameters × tokens (target: B × n nodes; drafter: B × its block), as for the projections.
Time = max(bytes / bandwidth, FLOPs / peak) + launches × launch cost (cure_jax/costs/roofline).
A budget n ≤ the block verifies the first n nodes of the draft: bytes of the chain program,
FLOPs of n nodes; for an MoE target the experts the batch's B x n tokens reach replace the
chain program's (uniform routing, the counter's rule), the rest of its bytes linear in B.
τ(n) for a prefix comes from a per-depth acceptance α fitted to a whole
block's τ: τ(n) = Σ_{d<n} α^d (the bonus token included), the calibrated drafter's expectation.
"""

from __future__ import annotations

from cure_jax.costs import roofline


def reached(rec: dict, tokens: int) -> float:
  """Expert bytes `tokens` tokens reach under uniform routing, E (1 - (1 - k/E)^N) of the
  experts (hlo_traffic's rule for grouped kernels); 0 for a dense target."""
  w = rec["weights"]
  return w.get("experts", 0.0) * (1.0 - (1.0 - w.get("experts_per_token", 0.0)) ** tokens)


def bytes_at(rec_a: dict, rec_b: dict, batch: int, nodes: int | None = None) -> float:
  """HBM bytes of one iteration at `batch` verifying `nodes` per row (default: what the records
  verify), linear in the batch through two records of other batch sizes. For an MoE target
  only the rest is linear: the experts the batch x nodes tokens reach are added by `reached`
  (an MoE verify's cost is concave in its tokens)."""
  verify = lambda r: r.get("verify_tokens", 1)                           # noqa: E731
  (b0, y0), (b1, y1) = ((r["batch"], r["iteration"]["hbm_bytes"] - reached(r, r["batch"] *
                                                                          verify(r)))
                        for r in (rec_a, rec_b))
  rest = y0 + (y1 - y0) * (batch - b0) / (b1 - b0)
  return rest + reached(rec_a, batch * (verify(rec_a) if nodes is None else nodes))


def iteration_ms(recs: tuple[dict, dict], device: str, batch: int, nodes: int,
                 block_size: int, launch_us: float = roofline.LAUNCH_US) -> float:
  """One iteration verifying `nodes` per row (1 with no drafter pass when the records are
  ar's) at `batch` on `device`."""
  w = recs[0]["weights"]
  draft = 0.0 if recs[0]["method"] == "ar" else w.get("drafter", 0.0) * block_size
  flops = batch * (w["target"] * nodes + draft)
  launches = max(roofline.launch_ms(r, launch_us) for r in recs)
  return roofline.iteration_ms(bytes_at(*recs, batch, nodes), flops, device) + launches


def prefix_tau(block_tau: float, block_size: int, nodes: int) -> float:
  """τ of the first `nodes` nodes of a block whose whole τ is block_tau (geometric depths)."""
  if block_tau >= block_size:
    return float(nodes)
  lo, hi = 0.0, 1.0
  for _ in range(100):   # Σ_{d<K} α^d is increasing in α: bisect for block_tau
    alpha = (lo + hi) / 2
    lo, hi = (alpha, hi) if sum(alpha ** d for d in range(block_size)) < block_tau else (lo, alpha)
  return sum(alpha ** d for d in range(nodes))


def auto_rows(ar: tuple[dict, dict], chain: tuple[dict, dict], device: str, batches,
              budgets, block_tau: float, block_size: int,
              launch_us: float = roofline.LAUNCH_US) -> list[dict]:
  """Per batch size: every budget's projected tokens/s, and the one the controller picks."""
  def ms(batch, n):
    return iteration_ms(ar if n == 1 else chain, device, batch, n, block_size, launch_us)
  return choose(ms, device, batches, budgets, block_tau, block_size)


def measured_ms(curve_rows: list[dict]):
  """ms(batch, n) from cost curves timed on a device (experiments.device_costs' `curve` rows:
  one drafter pass plus the target over n nodes, seconds; a plain step has no drafter pass)."""
  table = {(r["batch"], n): 1000 * (v + (r["draft_s"] if n > 1 else 0.0))
           for r in curve_rows for n, v in zip(r["budgets"], r["verify_s"])}

  def ms(batch, n):
    if (batch, n) not in table:
      raise ValueError(f"the measured curves have no batch {batch} budget {n}; they hold "
                       f"{sorted(table)}")
    return table[(batch, n)]
  return ms


def choose(ms, device: str, batches, budgets, block_tau: float, block_size: int) -> list[dict]:
  """Per batch size: each budget's tokens/s from ms(batch, n), and the one the controller
  picks (the most expected tokens per second, τ(n) from the block's τ)."""
  rows = []
  for batch in batches:
    options = []
    for n in budgets:
      tau = prefix_tau(block_tau, block_size, n)
      options.append(dict(budget=n, tau=tau, iteration_ms=ms(batch, n),
                          tokens_per_s=1000 * batch * tau / ms(batch, n)))
    best = max(options, key=lambda o: o["tokens_per_s"])
    ar_tps = options[0]["tokens_per_s"] if budgets[0] == 1 else None
    rows.append(dict(device=device, batch=batch, block_tau=block_tau, options=options,
                     auto_budget=best["budget"], auto_tokens_per_s=best["tokens_per_s"],
                     auto_vs_ar=best["tokens_per_s"] / ar_tps if ar_tps else None))
  return rows
