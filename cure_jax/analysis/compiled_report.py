"""The markdown report of `experiments.aot`: per compiled program, its memory, collectives,
kernels, XLA's cost analysis and the HBM traffic counted from its HLO, and what did not compile."""

from cure_jax.analysis import report

def gb(x) -> str:
  return "" if x is None else f"{x / 1e9:.2f}"


def mb(x) -> str:
  return "?" if x is None else f"{x / 1e6:,.1f}"


def _launches(rec: dict) -> str:
  """Kernels per iteration: GPU thunks (host launches), else the Pallas / Mosaic TPU kernels."""
  gpu = (rec.get("gpu_launches") or {}).get("iteration")
  if gpu:
    return f"{gpu['kernels']} ({gpu['launches']})"
  return str(rec["iteration"].get("kernels", 0))


def markdown(meta: dict, records: list[dict]) -> str:
  lines = [f"# AOT compile: {meta['target']} + {meta['drafter']} on {meta['topology']}",
           "", f"mesh data={meta['mesh'][0]} model={meta['mesh'][1]}, dtype {meta['dtype']}, "
           f"max_len {meta['max_len']}, prompt bucket {meta['prompt_len']}; per chip: target "
           f"weights {gb(meta['weights']['target'])} GB, target KV "
           f"{gb(meta['weights']['target_kv'])} GB" + (
               f", drafter {gb(meta['weights']['drafter'])} GB"
               if "drafter" in meta["weights"] else "") + "." + (
               f" XLA options: {meta['compiler_options']}." if meta.get("compiler_options")
               else "") + (
               f" Draft vocabulary: {meta['draft_vocab']} tokens ({meta['draft_vocab_ids']})."
               if meta.get("draft_vocab") else ""), ""]
  moe = any("hbm_over_moe_minimum" in r.get("bounds", {}) for r in records)
  rows = []
  for r in (r for r in records if not r.get("failed")):
    it = r["iteration"]
    labels = it["by_label"]
    weights = sum(v for k, v in labels.items() if k.endswith(("weights", "head")))
    b = r["bounds"]
    rows.append([r["case"], r["compile_s"], gb(r["argument_bytes"]), gb(r["temp_bytes"]),
                 gb(r["output_bytes"]), str(r.get("donated_state_aliased", "")),
                 ", ".join(f"{k} {v}" for k, v in it["collectives"].items()) or "0",
                 it["fusions"], _launches(r), f"{r['xla_flops'] / 1e9:.1f}",
                 gb(r["xla_bytes_accessed"]),
                 gb(it["hbm_bytes"]), gb(weights), gb(it["on_chip_bytes_skipped"]),
                 f"{b['hbm_over_weights_and_kv']:.3f}",
                 f"{b['hbm_over_chain_minimum']:.3f}" if "hbm_over_chain_minimum" in b else ""] +
                ([f"{b['hbm_over_moe_minimum']:.3f}" if "hbm_over_moe_minimum" in b else ""]
                 if moe else []))
  lines.append(report.md_table(
      ["program", "compile s", "args GB", "temp GB", "out GB", "state aliased", "collectives",
       "fusions", "kernels (launches)", "XLA GFLOP", "XLA GB", "HBM GB", "of which weights", "on-chip GB skipped",
       "HBM / (W + KV)", "HBM / chain min"] + (["HBM / MoE min"] if moe else []), rows))
  failed = [r for r in records if r.get("failed")]
  if failed:
    lines += ["", "Did not compile:", ""] + [
        f"- {r['case']}: asked {mb(r['bytes_asked'])} MB of {mb(r['bytes_available'])} MB "
        f"of {r.get('memory', 'hbm')}: {r['error'].splitlines()[0][:300]}"
        for r in failed]
  lines += ["", "Per iteration of the decode loop, per whole prefill (one chunk's traffic x "
            f"the chunks, {meta['prompt_len']} tokens in chunks of at most "
            f"{meta.get('prefill_chunk', '?')}: {PREFILL_RULE}), per pass of forward. XLA's figures "
            "are its cost analysis of the whole module; HBM GB counts the HBM side of each "
            "top-level op of the optimized HLO (cure_jax/costs/hlo_traffic.py): on-chip buffers and "
            "the parts of operands that slices do not read are not counted, which is why it is "
            "below XLA's bytes accessed." + (
                " MoE min: ar's or chain's minimum with only the experts the iteration's tokens "
                "reach under uniform routing, E (1 - (1 - k / E)^N) of E for N = batch x tokens "
                "verified per row." if moe else ""), ""]
  return "\n".join(lines) + "\n"


PREFILL_RULE = ("the whole prefill: one chunk's HBM bytes x the chunks, its loop over cache "
                "blocks counted once; chunk i reads i cache blocks, so the blocks beyond one "
                "per chunk are added (label cache_blocks_beyond_one): n (n - 1) / 2 - n of them")
