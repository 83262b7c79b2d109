"""The peers table: other implementations on the same weights and prompts, in the same run.

transformers `generate` (torch CPU float32) and the `dflash` wheel's chain decoding beside our
ar, chain and cure: τ, tokens/s, TPOT, equality with our ar. Also where one of our iterations
goes (draft, verify, commit phases) and each method's distance from this machine's roofline
floor.
"""

from __future__ import annotations

import time
from typing import Sequence

import numpy as np

from cure_jax.analysis import replay
from cure_jax.costs import efficiency
from cure_jax.analysis.report import md_table, num
from experiments.tables.bench import (Bench, Variant, _generator, _indices, _progress, run_variants,
                                      summarize, write_outputs)


def table_peers(bench: Bench) -> dict:
  """transformers `generate` (torch CPU float32) and the `dflash` wheel's chain decoding on the
  same weights and prompts, beside ours, in the same run."""
  idx = _indices(bench)
  ours_v = [Variant.of("ar", "ar"), Variant.of("chain", "chain"), Variant.of("cure", "cure")]
  runs = run_variants(bench, ours_v, idx, "peers (ours)")
  sums = {v.label: summarize(runs[v.label], None if v.label == "ar" else runs["ar"])
          for v in ours_v}
  rows = []
  for v in ours_v:
    s = sums[v.label]
    rows.append(dict(system=f"cure_jax {v.label}", tau=s["tau"] if v.label != "ar" else 1.0,
                     tokens_per_s=s["tokens_per_s"], tpot_ms=s["tpot_ms"],
                     equal_to_our_ar=len(idx) - s.get("mismatches_vs_ar", 0)))
  notes = []
  if not bench.target_dir:
    notes.append("no HF target directory: transformers and dflash peers skipped")
  else:
    try:
      rows += _peer_rows(bench, idx, runs)
    except ImportError as e:
      notes.append(f"peers skipped: {e}")
  phases = {v.label: replay.phase_ms(_generator(bench, v), bench.ids[idx[0]])
            for v in ours_v}
  peaks = efficiency.machine_peaks()
  cure = _generator(bench, ours_v[2]).cure
  gate = sums["cure"]["gate_rate"]
  floors = efficiency.floors_ms(bench.target, bench.drafter, peaks,
                                {m: max(s["nodes_verified"], 1.0) for m, s in sums.items()},
                                repair_paths=gate * cure.num_paths, repair_rows=gate * cure.v_max)
  iteration = {m: s["tpot_ms"] * max(s["tau"], 1.0) for m, s in sums.items()}
  ar_bound = _ar_bound(rows, floors["ar"]["verify_ms"], peaks)
  payload = dict(prompts=len(idx), rows=rows, notes=notes, phases_ms=phases, peaks=peaks,
                 floors_ms=floors, iteration_ms=iteration, ar_vs_transformers=ar_bound)
  md = [f"## Peers on {len(idx)} prompts (same weights, same run, CPU)", "",
        md_table(["system", "τ", "tokens/s", "TPOT ms", "= our ar (prompts)"],
                 [[r["system"], num(r["tau"]), num(r["tokens_per_s"], ".1f"),
                   num(r["tpot_ms"], ".2f"),
                   "n/a" if r["equal_to_our_ar"] is None else f"{r['equal_to_our_ar']}/{len(idx)}"]
                  for r in rows]),
        "\ntokens/s excludes prefill for every system (transformers: generate time minus a "
        "separately timed prefill forward).", "",
        "Where one of our iterations goes (ms, batch 1, each phase jitted alone):", "",
        md_table(["method", "draft + tree build", "verify", "commit + resync"],
                 [[m, num(p["draft_and_tree_ms"], ".2f"), num(p["verify_ms"], ".2f"),
                   num(p["commit_and_resync_ms"], ".2f")] for m, p in phases.items()]),
        "", f"Against the roofline floor of this machine (measured here: "
        f"{peaks['gflops']:.0f} GFLOP/s float32 matmul, {peaks['gbytes_per_s']:.1f} GB/s read; "
        "floor = max(FLOPs at that peak, weight bytes at that bandwidth), mean nodes per "
        "iteration from the runs above):", "",
        md_table(["method", "nodes/iter", "draft floor", "verify floor", "iteration floor",
                  "iteration measured (TPOT × τ)", "floor / measured"],
                 [[m, num(sums[m]["nodes_verified"], ".1f"), num(f["draft_ms"], ".2f"),
                   num(f["verify_ms"], ".2f"), num(f["total_ms"], ".2f"),
                   num(iteration[m], ".2f"), num(f["total_ms"] / iteration[m], ".2f")]
                  for m, f in floors.items()])]
  if ar_bound:
    md.append(f"\nOur ar is {ar_bound['measured']:.2f}× transformers `generate` here. A decode "
              f"step that only streamed the weights would be {ar_bound['at_read_floor']:.2f}×; one "
              f"whose matrix-vector products ran at the {peaks['gemv_gbytes_per_s']:.1f} GB/s "
              f"jitted matrix-vector products reach here, {ar_bound['at_gemv_floor']:.2f}×.")
  md += [f"\nNote: {n}" for n in notes]
  return write_outputs(bench, "peers", payload, "\n".join(md) + "\n")


def _ar_bound(rows: list[dict], ar_floor_ms: float, peaks: dict) -> dict | None:
  """Our ar's speedup over transformers `generate`, and the most it could be at this machine's
  weight-streaming floor and at its matrix-vector speed (AR is memory-bound)."""
  ours = next(r for r in rows if r["system"] == "cure_jax ar")
  hf = next((r for r in rows if r["system"].startswith("transformers")), None)
  if hf is None:
    return None
  gemv_floor_ms = ar_floor_ms * peaks["gbytes_per_s"] / peaks["gemv_gbytes_per_s"]
  return dict(measured=hf["tpot_ms"] / ours["tpot_ms"], at_read_floor=hf["tpot_ms"] / ar_floor_ms,
              at_gemv_floor=hf["tpot_ms"] / gemv_floor_ms)


def _peer_rows(bench: Bench, idx: Sequence[int], ours: dict) -> list[dict]:
  import warnings
  from unittest import mock

  import torch
  from transformers import AutoModelForCausalLM

  torch.manual_seed(0)
  target = AutoModelForCausalLM.from_pretrained(bench.target_dir, dtype=torch.float32).eval()
  max_new = int(bench.config.max_new_tokens)
  stops = [] if bench.config.ignore_eos else list(bench.stops)
  rows = []
  hf_ids, hf_s, hf_tok = [], 0.0, 0
  gen_kwargs = dict(max_new_tokens=max_new, do_sample=False, num_beams=1,
                    pad_token_id=stops[0] if stops else 0)
  if stops:
    gen_kwargs["eos_token_id"] = stops
  else:
    gen_kwargs.update(eos_token_id=None, min_new_tokens=max_new)
  with torch.no_grad(), warnings.catch_warnings():
    warnings.simplefilter("ignore")
    for i in _progress(idx, "peers (transformers)", bench):
      x = torch.tensor([bench.ids[i]])
      target(x)  # warm
      t0 = time.perf_counter()
      target(x)
      prefill = time.perf_counter() - t0
      t0 = time.perf_counter()
      out = target.generate(x, attention_mask=torch.ones_like(x), **gen_kwargs)
      total = time.perf_counter() - t0
      new = out[0, x.shape[1]:].tolist()
      hf_ids.append(new)
      hf_s += max(total - prefill, 1e-9)
      hf_tok += max(len(new) - 1, 0)
  same = sum(a == r.output_ids for a, r in zip(hf_ids, ours["ar"]))
  rows.append(dict(system="transformers generate (torch fp32)", tau=1.0,
                   tokens_per_s=hf_tok / hf_s, tpot_ms=1000 * hf_s / max(hf_tok, 1),
                   equal_to_our_ar=same))
  if not bench.drafter_dir:
    return rows
  from dflash import model as dflash_model
  from dflash.model import DFlashDraftModel, dflash_generate
  drafter = DFlashDraftModel.from_pretrained(bench.drafter_dir, dtype=torch.float32).eval()
  lens, d_s, d_tok, d_ids = [], 0.0, 0, []
  with torch.no_grad(), warnings.catch_warnings(), mock.patch.object(
      dflash_model, "_cuda_time", time.perf_counter):
    warnings.simplefilter("ignore")
    for n, i in enumerate(_progress(idx, "peers (dflash)", bench)):
      x = torch.tensor([bench.ids[i]])
      if n == 0:  # warm-up
        dflash_generate(drafter, target, x, max_new, stop_token_ids=stops or None,
                        temperature=0.0, return_stats=True)
      out = dflash_generate(drafter, target, x, max_new, stop_token_ids=stops or None,
                            temperature=0.0, return_stats=True)
      lens += list(out.acceptance_lengths)
      d_s += out.time_per_output_token * out.num_output_tokens
      d_tok += out.num_output_tokens
      d_ids.append(out.output_ids[0, x.shape[1]:].tolist())
  same = sum(a == r.output_ids for a, r in zip(d_ids, ours["ar"]))
  rows.append(dict(system="dflash wheel dflash_generate (torch fp32)", tau=float(np.mean(lens)),
                   tokens_per_s=d_tok / max(d_s, 1e-9), tpot_ms=1000 * d_s / max(d_tok, 1),
                   equal_to_our_ar=same))
  return rows
