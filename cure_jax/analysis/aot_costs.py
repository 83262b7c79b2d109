"""What a program compiled for a device we do not have costs: compile seconds, per-chip memory,
XLA's cost analysis, the GPU launches, and an independent count of the HBM traffic of one loop
iteration (`cure_jax.costs.hlo_traffic`), set against the weights and the KV caches it must
read."""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding

from cure_jax import methods
from cure_jax.analysis import compiled_report, report
from cure_jax.analysis.aot_programs import Case, abstract_cache, entry_labels
from cure_jax.costs import hlo_traffic, launches, refusals
from cure_jax.runtime import pipeline, sharding, xla_options


def per_chip_bytes(tree) -> float:
  """Bytes one device holds of an abstract tree whose leaves carry shardings."""
  total = 0.0
  for x in jax.tree.leaves(tree):
    shape = x.sharding.shard_shape(x.shape) if isinstance(x.sharding, NamedSharding) else x.shape
    total += float(np.prod(shape)) * jnp.dtype(x.dtype).itemsize
  return total


def weight_bytes(target, drafter, mesh, batch: int, max_len: int,
                 draft_vocab: int = 0) -> dict[str, float]:
  """Per-chip bytes of the target / drafter weights, lm_head and the KV caches; with a draft
  vocabulary of N tokens also draft_head, the N of lm_head's rows the drafter reads."""
  place = sharding.Placement(mesh)

  def chip(module, only=None):
    state = place.annotate(nnx.state(module))
    flat = [(p, v.get_value()) for p, v in nnx.to_flat_state(state)]
    return per_chip_bytes([x for p, x in flat if only is None or only in "/".join(map(str, p))])

  def kv(model):
    cache = abstract_cache(model, batch, max_len, mesh)
    return per_chip_bytes([cache.k, cache.v])

  head = "embed_tokens" if target.cfg.tie_embeddings else "lm_head"
  out = dict(target=chip(target), lm_head=chip(target, head), target_kv=kv(target))
  if target.cfg.moe:   # the experts, and the share of them one token routes to (top_k / E)
    out.update(experts=chip(target, "experts"),
               experts_per_token=target.cfg.moe.top_k / target.cfg.moe.num_experts)
  if drafter is not None:
    out.update(drafter=chip(drafter), drafter_kv=kv(drafter))
    if draft_vocab:
      out.update(draft_head=out["lm_head"] * draft_vocab / target.cfg.vocab_size)
  return out


def launch_counts(dump: str, program: str) -> dict | None:
  """Kernels and launches of the module just compiled for `program` (its newest thunk dump)."""
  module = "jit_start" if program == "prefill" else "jit_run"
  found = sorted(Path(dump).glob(f"*.{module}.thunk_sequence_after_thunk_passes.txt"),
                 key=lambda p: p.stat().st_mtime)
  return launches.count(found[-1].read_text()) if found else None


def prefill_chunks(prompt_len: int, prefill_chunk: int) -> int:
  """Chunks of a prompt_len prefill (the chunk is prefill_chunk, at most the prompt)."""
  return -(-prompt_len // min(prefill_chunk, prompt_len))


def analyse(case: Case, lowered, weights: dict[str, float], dump: str | None = None,
            options: dict[str, str] | None = None, verify_tokens: int = 1,
            chunks: int = 1, dump_hlo: str = "") -> dict:
  """Compile one lowered program and read its costs; verify_tokens: tokens a row verifies per
  iteration (1 for ar and forward, the block for chain, the node budget for trees); chunks: a
  prefill's chunks (prefill_chunks); dump_hlo: a folder for the module and its labels."""
  t0 = time.perf_counter()
  compiled = xla_options.compile_with(lowered, options)
  compile_s = time.perf_counter() - t0
  mem = compiled.memory_analysis()
  cost = compiled.cost_analysis() or {}
  text = compiled.as_text()
  labels = entry_labels(lowered, case.program)
  if dump_hlo:  # the module and its parameter labels: hlo_traffic.count(text, labels)
    stem = Path(dump_hlo) / case.name.replace("/", "_")
    report.write_text(stem.with_suffix(".hlo"), text)
    pipeline.write_json(str(stem.with_suffix(".labels.json")), labels)
  rec = dict(case=case.name, program=case.program, method=case.method, batch=case.batch,
             v_max=case.v_max, compile_s=round(compile_s, 2),
             argument_bytes=mem.argument_size_in_bytes, temp_bytes=mem.temp_size_in_bytes,
             output_bytes=mem.output_size_in_bytes, alias_bytes=mem.alias_size_in_bytes,
             xla_flops=float(cost.get("flops", 0.0)),
             xla_bytes_accessed=float(cost.get("bytes accessed", 0.0)), weights=weights,
             verify_tokens=verify_tokens)
  if case.program == "prefill":  # its loop is one chunk; traffic_record scales it to them all
    rec["prefill_chunks"] = chunks
  if case.program == "decode":  # its output is the state: donation works when it aliases
    rec["donated_state_aliased"] = bool(mem.alias_size_in_bytes >= 0.9 * mem.output_size_in_bytes)
  if dump and case.program != "forward":
    rec["gpu_launches"] = launch_counts(dump, case.program)
  return traffic_record(rec, text, labels)


def failure(case: Case, error: Exception) -> dict:
  """The record of a program the compiler refused: its message and, when the message says,
  the bytes the program asked for and the bytes the device has."""
  return dict(case=case.name, program=case.program, method=case.method, batch=case.batch,
              v_max=case.v_max, **refusals.read(error))


def traffic_bounds(case: Case, loop: dict, w: dict[str, float], verify_tokens: int = 1) -> dict:
  """The yardsticks for one iteration: ar / forward against weights + target KV; chain
  against its minimum (target, drafter layers, one more lm_head read, both caches). For an MoE
  target also the MoE minimum: the same with only the experts the iteration's batch x
  verify_tokens tokens route to, under uniform routing (hlo_traffic's rule for the GPU kernel)."""
  hbm = loop["hbm_bytes"]
  target_min = w["target"] + w["target_kv"]
  out = dict(per_chip_weights=w["target"], target_kv=w["target_kv"],
             hbm_over_weights=hbm / w["target"], hbm_over_weights_and_kv=hbm / target_min)
  block = methods.get(case.method).drafter_kind == "block"
  if block:   # the drafter's head read: its draft vocabulary's rows (draft_head) or all of them
    chain_min = target_min + w["drafter"] + w.get("draft_head", w["lm_head"]) + w["drafter_kv"]
    out.update(chain_minimum=chain_min, hbm_over_chain_minimum=hbm / chain_min)
  if w.get("experts"):
    tokens = case.batch * verify_tokens
    unread = w["experts"] * (1.0 - w["experts_per_token"]) ** tokens
    moe_min = (chain_min if block else target_min) - unread
    out.update(moe_minimum=moe_min, moe_tokens=tokens, hbm_over_moe_minimum=hbm / moe_min)
  return out


def traffic_record(rec: dict, text: str, labels: dict[int, str]) -> dict:
  """rec with the HBM count of `text` (one iteration of its loop, else the whole program)."""
  traffic = hlo_traffic.count(text, labels)
  loop = traffic["loops"][0] if traffic["loops"] else traffic["program"]
  chunks = rec.get("prefill_chunks")
  if chunks and traffic["loops"]:   # the whole prefill (compiled_report.PREFILL_RULE)
    block = loop["nested_loop_iteration_bytes"]           # one cache block, every layer
    by_label = {k: v * chunks for k, v in loop["by_label"].items()}
    by_label["cache_blocks_beyond_one"] = (chunks * (chunks - 1) / 2 - chunks) * block
    loop = dict(loop, hbm_bytes=sum(by_label.values()), by_label=by_label,
                chunk_hbm_bytes=loop["hbm_bytes"], chunks=chunks,
                rule=compiled_report.PREFILL_RULE)
  case = Case(rec["program"], rec["method"], rec["batch"], rec["v_max"])
  return dict(rec, iteration=loop,
              outside_loops=traffic["outside_loops"] if traffic["loops"] else None,
              bounds=traffic_bounds(case, loop, rec["weights"], rec.get("verify_tokens", 1)))


def recount(output: str, dump: str) -> int:
  """Rewrites a report from its dumped modules (after a change of hlo_traffic); returns the
  number of programs recounted."""
  if not dump:
    raise ValueError("--recount reads the modules of --dump_hlo=DIR")
  data = json.loads(Path(output + ".json").read_text())
  for i, rec in enumerate(data["records"]):
    stem = Path(dump) / rec["case"].replace("/", "_")
    if not stem.with_suffix(".hlo").is_file():
      raise ValueError(f"{stem}.hlo is missing: run with --dump_hlo={dump} first")
    labels = {int(k): v for k, v in json.loads(stem.with_suffix(".labels.json").read_text()).items()}
    data["records"][i] = traffic_record(rec, stem.with_suffix(".hlo").read_text(), labels)
  pipeline.write_json(output + ".json", data)
  report.write_text(output + ".md", compiled_report.markdown(data["meta"], data["records"]))
  return len(data["records"])
