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

import json
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from flax import nnx

from cure_jax.analysis import random_models
from cure_jax.checkpoints import dflash as convert_dflash, qwen3 as convert_qwen3
from cure_jax.checkpoints.store import read_hf_config
from cure_jax.costs import efficiency
from cure_jax.models.kernels import gpu_layer
from cure_jax.runtime import cost_curve, decoding, errors, files
from cure_jax.runtime.generation import Generator, decoding_spec
from cure_jax.tree import controller, repair

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

# what --small keeps of a config.json: a model that compiles and runs in seconds on a CPU
_SMALL_SIZES = dict(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                    num_target_layers=4, block_size=16)


# the numerics part's pair: Qwen3-8B's layer layout (GQA 4, head 128) at a size whose
# invariant and default programs compile and decode in seconds on an accelerator
_NUMERICS_SIZES = dict(vocab_size=8192, hidden_size=1024, intermediate_size=3072,
                       num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=128, num_target_layers=4, block_size=16)


def _config(path: str, sizes: dict | None = None) -> dict:
  """path's config.json, scaled to `sizes` (to _SMALL_SIZES with --small); a scaled drafter has
  one layer reading target layers 1 and 2."""
  config = read_hf_config(path)
  sizes = _SMALL_SIZES if _SMALL.value else sizes
  if not sizes:
    return config
  config = {**config, **{k: v for k, v in sizes.items() if k in config}}
  if "dflash_config" in config:
    config["num_hidden_layers"] = 1
    config["dflash_config"] = dict(config["dflash_config"], mask_token_id=sizes["vocab_size"] - 1,
                                   target_layer_ids=[1, 2])
  return config


def _dtype():
  """bf16 as on accelerators; float32 for --small (the CPU backend has no bf16 dot thunks)."""
  return jnp.float32 if _SMALL.value else jnp.bfloat16


def _pair():
  """Qwen3-8B and its DFlash drafter with random weights, built on the default device."""
  dtype = _dtype()
  target = convert_qwen3.FAMILY.build(_config(_TARGET.value), dtype)
  drafter = convert_dflash.FAMILY.build(_config(_DRAFTER.value), dtype)
  return target, drafter


def _ints(values) -> tuple[int, ...]:
  return tuple(int(v) for v in values)


_START = time.perf_counter()


def _in_time(what: str) -> bool:
  """False (and says so) once --deadline_s has passed: `what` is not started."""
  if time.perf_counter() - _START <= _DEADLINE.value:
    return True
  print(f"{what}: skipped (past --deadline_s={_DEADLINE.value:.0f})")
  return False


def smoke() -> dict:
  """Greedy tokens of every method against target-only decoding, on small random pairs."""
  out = {}
  for name, arch in (("dense", random_models.Arch(vocab=64, hidden=64, head_dim=16)),
                     ("moe", random_models.Arch(vocab=64, hidden=64, head_dim=16, experts=8))):
    for seed in range(1):  # losslessness at scale is the CPU suite's; this checks the device
      target, drafter = random_models.pair(arch, seed)
      prompts = random_models.prompts(seed, arch.vocab, 4)
      want = [r.output_ids for r in Generator(target, method="ar",
                                              max_new_tokens=24).generate(prompts)]
      for method in ("chain", "ddtree", "cure", "auto"):
        got = [r.output_ids for r in Generator(target, drafter, method=method,
                                           max_new_tokens=24).generate(prompts)]
        key = f"{name} seed {seed} {method}"
        out[key] = sum(g != w for g, w in zip(got, want))
        print(f"smoke {key}: {out[key]} of {len(prompts)} prompts differ from target-only")
  return dict(differ=out, all_equal=not any(out.values()))


def curve() -> dict:
  """cost_curve.time_budgets at each batch: the seconds auto's controller would use here."""
  target, drafter = _pair()
  auto = controller.Settings(budgets=_ints(_BUDGETS.value))
  gen = Generator(target, drafter, method="auto", max_new_tokens=64, auto=auto)
  spec = decoding_spec("auto", drafter, 64, _MAX_LEN.value, block_size=gen.block_size,
                       cure=gen.cure, auto=auto)
  rows = []
  for batch in filter(lambda b: _in_time(f"curve batch {b}"), _ints(_BATCHES.value)):
    t0 = time.perf_counter()
    row = cost_curve.time_budgets(gen.graphdef, gen.params, spec, batch)
    row.update(batch=batch, wall_s=time.perf_counter() - t0)
    print(f"curve batch {batch}: draft {1e3 * row['draft_s']:.2f} ms, verify " +
          ", ".join(f"n={n} {1e3 * s:.2f}" for n, s in zip(auto.budgets, row["verify_s"])) +
          f" ms ({row['wall_s']:.0f} s with compiles)")
    rows.append(row)
  return dict(max_len=_MAX_LEN.value, rows=rows)


def prefill() -> dict:
  """One prompt of --prompt_len tokens through chain's compiled prefill at each chunk size."""
  target, drafter = _pair()
  p = _PROMPT_LEN.value
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (1, p)), jnp.int32)
  rows = []
  for chunk in filter(lambda c: _in_time(f"prefill chunk {c}"), _ints(_CHUNKS.value)):
    gen = Generator(target, drafter, method="chain", max_new_tokens=8, prefill_chunk=chunk)
    spec = gen.spec(gen.cache_len(p))
    t0 = time.perf_counter()
    plen, key = jnp.array([p], jnp.int32), jax.random.key(0)
    fn = decoding.prefill.lower(gen.graphdef, gen.params, prompt, plen, key, spec=spec).compile()
    compile_s = time.perf_counter() - t0
    runs = []
    for _ in range(3):
      t0 = time.perf_counter()
      jax.block_until_ready(fn(gen.params, prompt, plen, key).anchor)
      runs.append(time.perf_counter() - t0)
    best = min(runs[1:])
    rows.append(dict(chunk=chunk, seconds=best, tokens_per_s=p / best, compile_s=compile_s,
                     runs_s=runs))
    print(f"prefill {p} tokens, chunk {chunk}: {best:.3f} s ({p / best:,.0f} tokens/s; "
          f"compile {compile_s:.0f} s)")
  return dict(prompt_len=p, rows=rows,
              fastest=min(rows, key=lambda r: r["seconds"])["chunk"] if rows else None)


def moe() -> dict:
  """C_v(n) of the MoE target at batch 1 (ms per target forward over n chain nodes)."""
  target = convert_qwen3.FAMILY.build(_config(_MOE.value), _dtype())
  nbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(target)))
  verify = {}
  for n in filter(lambda n: _in_time(f"moe C_v({n})"), _ints(_NODES.value)):
    verify.update(efficiency.verify_cost(target, (n,), context=512))
    print(f"moe C_v({n}) = {verify[n]:.2f} ms")
  return dict(target_bytes=nbytes, verify_ms=verify)


def steps() -> dict:
  """The older measurement: C_v, C_d and loop ms per iteration (batch 1, prompt 64)."""
  target, drafter = _pair()
  costs = efficiency.measure(target, drafter, context=512, num_paths=5,
                             feature_layers=drafter.cfg.feature_layers)
  loops = {}
  for method in ("ar", "chain", "cure"):
    cure = repair.RepairConfig(tau_margin=1e9, max_depth=drafter.cfg.block_size - 1, v_max=64)
    gen = Generator(target, drafter, method=method, max_new_tokens=64,
                    cure=cure if method == "cure" else None)
    prompt = list(range(10, 74))
    gen.generate([prompt])  # compile + warm-up
    r = gen.generate([prompt])[0]
    loops[method] = 1000.0 * r.decode_s / max(r.iterations, 1)
    print(f"steps {method}: {loops[method]:.2f} ms per iteration")
  return dict(costs=costs, loop_ms_per_iteration=loops)


def _gemm_tflops() -> float:
  """This device's dense bf16 matmul rate: the best of 5 products of two n x n matrices."""
  n = 1024 if _SMALL.value else 8192
  a = jnp.ones((n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(f(a, a))
  runs = []
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(f(a, a))
    runs.append(time.perf_counter() - t0)
  return 2 * n ** 3 / min(runs) / 1e12


def _copy_gbps() -> float:
  """This device's HBM bandwidth: the best of 5 passes of x + 1 over a 2 GiB bf16 array (one
  read and one write of it)."""
  n = (32 if _SMALL.value else 1024) * 2 ** 20
  x = jnp.ones((n,), jnp.bfloat16)
  f = jax.jit(lambda x: x + 1)
  jax.block_until_ready(f(x))
  runs = []
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    runs.append(time.perf_counter() - t0)
  return 2 * x.nbytes / min(runs) / 1e9


def _loop_programs(block: int) -> list[tuple[str, int, repair.RepairConfig | None]]:
  """(method, nodes verified a row per iteration, tree settings) in the order they are timed."""
  out = [("ar", 1, None), ("chain", block, None)]
  out += [("ddtree", n, repair.RepairConfig(max_depth=block - 1, v_max=n))
          for n in _ints(_TREE_NODES.value)]
  cure = repair.RepairConfig(tau_margin=1e9, max_depth=block - 1, v_max=64)  # repair every block
  return out + [("cure", 64, cure), ("auto", block, None)]


def _loop_variants(block: int, batch: int):
  """(method, nodes, tree settings, layer_kernels) in order: ar, chain and ddtree where the
  target's layers take gpu_layer's kernels again with XLA's fusions, so that the timing decides
  between them."""
  for method, nodes, cure in _loop_programs(block):
    yield method, nodes, cure, True
    if method in ("ar", "chain", "ddtree") and batch * nodes <= gpu_layer.MAX_ROWS:
      yield method, nodes, cure, False


def loops() -> dict:
  """ms per iteration of each compiled decode loop and its count at the measured figures."""
  from cure_jax.costs import hlo_traffic
  gbps, tflops = _copy_gbps(), _gemm_tflops()
  print(f"loops: HBM {gbps:.0f} GB/s (copy), bf16 GEMM {tflops:.1f} TFLOP/s")
  target, drafter = _pair()
  rng = np.random.default_rng(0)
  records = []
  for batch in _ints(_LOOP_BATCHES.value):
    prompts = rng.integers(0, 1000, (batch, 64)).tolist()
    for method, nodes, cure, kernels in _loop_variants(drafter.cfg.block_size, batch):
      if not _in_time(f"loops {method}/{nodes} batch {batch} layer_kernels={kernels}"):
        continue
      target.layer_kernels = kernels
      try:
        gen = Generator(target, drafter if method != "ar" else None, method=method, cure=cure,
                        max_new_tokens=_LOOP_TOKENS.value)
        gen.generate(prompts)                                  # compile and warm up
        results = gen.generate(prompts)
      except Exception as e:  # e.g. out of memory: the next program still runs
        print(f"loops {method}/{nodes} batch {batch}: FAILED {type(e).__name__}: {e}"[:400])
        records.append(dict(method=method, batch=batch, nodes=nodes, layer_kernels=kernels,
                            failed=str(e)[:2000]))
        continue
      iterations = max(r.iterations for r in results)
      ms = 1000.0 * results[0].decode_s / iterations
      it = hlo_traffic.count(gen.compiled_decode(batch, 64).as_text())["loops"][0]
      count_ms = 1000.0 * max(it["hbm_bytes"] / (gbps * 1e9), it["dot_flops"] / (tflops * 1e12))
      records.append(dict(method=method, batch=batch, nodes=nodes, layer_kernels=kernels,
                          ms_per_iteration=ms,
                          count_ms=count_ms, ratio=ms / count_ms, iterations=iterations,
                          hbm_bytes=it["hbm_bytes"], flops=it["dot_flops"],
                          device=jax.devices()[0].device_kind, jax=jax.__version__))
      print(f"loops {method}/{nodes} batch {batch} layer_kernels={kernels}: {ms:.2f} ms per "
            f"iteration, count "
            f"{count_ms:.2f} ms ({ms / count_ms:.2f}x; {it['hbm_bytes'] / 1e9:.2f} GB, "
            f"{it['dot_flops'] / 1e12:.3f} TFLOP an iteration)", flush=True)
      files.write_json(str(Path(_OUTPUT_DIR.value) / "loops.json"),   # so far, in case of a kill
                       dict(_device(), partial=True, hbm_gbps=gbps, bf16_tflops=tflops,
                            records=records))
  return dict(hbm_gbps=gbps, bf16_tflops=tflops, records=records)


def loops_markdown(result: dict) -> str:
  """loops.json as a table."""
  lines = [f"# Decode loops timed on {result['device_kind']} (jax {result['jax']})", "",
           f"HBM {result['hbm_gbps']:.0f} GB/s (copy), bf16 GEMM {result['bf16_tflops']:.1f} "
           "TFLOP/s, both measured here; count = max(bytes / bandwidth, FLOPs / peak) of one "
           "iteration of the same compiled program.", "",
           "| method | nodes | batch | layer kernels | ms / iteration | count ms | ratio |",
           "|---|---|---|---|---|---|---|"]
  for r in (r for r in result["records"] if "failed" not in r):
    lines.append(f"| {r['method']} | {r['nodes']} | {r['batch']} | "
                 f"{r.get('layer_kernels', True)} | {r['ms_per_iteration']:.2f} | "
                 f"{r['count_ms']:.2f} | {r['ratio']:.2f} |")
  return "\n".join(lines) + "\n"


def train() -> dict:
  """Seconds per online training step (the 3rd to 5th after compiling), tokens/s and MFU (the
  step's model FLOPs, training/program.model_flops, over the measured peak)."""
  from configs.train import qwen3_8b
  from cure_jax.training import objective, program
  peak = _gemm_tflops()
  print(f"train: bf16 GEMM peak {peak:.1f} TFLOP/s")
  target = convert_qwen3.FAMILY.build(_config(_TARGET.value), jnp.bfloat16)
  config = qwen3_8b.get_config()
  if _SMALL.value:
    config.model.update(num_layers=1, target_layer_ids=(1, 2), mask_token_id=4095)
  rows = []
  for n in filter(lambda n: _in_time(f"train {n} rows"), _ints(_TRAIN_ROWS.value)):
    config.train.seqs_per_step = n
    static, (state, frozen, batch) = program.random_inputs(config, target, _TRAIN_LEN.value)
    flops = program.model_flops(config, target.cfg, _TRAIN_LEN.value)["total"]
    try:
      t0 = time.perf_counter()
      step = objective.train_step.lower(*static, state, frozen, batch).compile()
      compile_s, runs = time.perf_counter() - t0, []
      for _ in range(5):
        t0 = time.perf_counter()
        state, metrics = step(state, frozen, batch)
        jax.block_until_ready(metrics["loss"])
        runs.append(time.perf_counter() - t0)
    except jax.errors.JaxRuntimeError as e:   # does not fit: the next, smaller batch
      print(f"train {n} rows: {str(e).splitlines()[0][:200]}")
      rows.append(dict(rows=n, failed=str(e)[:2000]))
      continue
    s = float(np.median(runs[2:]))
    row = dict(rows=n, seq_len=_TRAIN_LEN.value, step_s=s, runs_s=runs, compile_s=compile_s,
               tokens_per_s=n * _TRAIN_LEN.value / s, model_flops=flops,
               mfu=flops / s / (peak * 1e12))
    rows.append(row)
    print(f"train {n} x {_TRAIN_LEN.value}: {s:.3f} s per step, {row['tokens_per_s']:,.0f} "
          f"tokens/s, MFU {row['mfu']:.3f} of the measured peak (compile {compile_s:.0f} s)")
    break
  return dict(gemm_bf16_tflops=peak, rows=rows)


def numerics() -> dict:
  """numerics=invariant on this device, beside the default mode: greedy ar, chain and ddtree at
  batch 8 (the default mode: ar only, for its time) against target-only decoding of each prompt
  alone, and the target-only ms per token at batch 1 and 8 (second runs: compiled and warm)."""
  dtype = _dtype()
  target = convert_qwen3.FAMILY.build(_config(_TARGET.value, _NUMERICS_SIZES), dtype)
  drafter = convert_dflash.FAMILY.build(_config(_DRAFTER.value, _NUMERICS_SIZES), dtype)
  prompts = random_models.prompts(0, target.cfg.vocab_size, 8, lo=32, hi=32)   # one shape
  tokens = _NUMERICS_TOKENS.value
  modes = {}
  for mode in ("invariant", "default"):
    if not _in_time(f"numerics {mode}"):
      continue
    target.numerics = mode
    alone = Generator(target, method="ar", max_new_tokens=tokens)
    want = [alone.generate([p])[0].output_ids for p in prompts]
    row = dict(differ={}, tpot_ms={})
    for method in ("ar", "chain", "ddtree") if mode == "invariant" else ("ar",):
      gen = Generator(target, drafter if method != "ar" else None, method=method,
                      max_new_tokens=tokens)
      got = gen.generate(prompts)
      row["differ"][method] = sum(r.output_ids != w for r, w in zip(got, want))
      if method == "ar":
        row["tpot_ms"][8] = gen.generate(prompts)[0].tpot_ms
    row["tpot_ms"][1] = alone.generate(prompts[:1])[0].tpot_ms
    modes[mode] = row
    print(f"numerics {mode}: of {len(prompts)} prompts at batch 8, " +
          ", ".join(f"{m} {n}" for m, n in row["differ"].items()) +
          " differ from target-only one at a time; target-only " +
          ", ".join(f"batch {b} {ms:.2f} ms" for b, ms in row["tpot_ms"].items()) + " a token")
  target.numerics = "default"
  overhead = ({b: modes["invariant"]["tpot_ms"][b] / modes["default"]["tpot_ms"][b]
               for b in (1, 8)} if len(modes) == 2 else {})
  return dict(sizes=_SMALL_SIZES if _SMALL.value else _NUMERICS_SIZES, dtype=str(dtype),
              prompts=len(prompts), tokens=tokens, modes=modes, tpot_overhead=overhead)


def _device() -> dict:
  return dict(device_kind=jax.devices()[0].device_kind, backend=jax.default_backend(),
              jax=jax.__version__, small=_SMALL.value)


RUNS = dict(smoke=smoke, curve=curve, prefill=prefill, moe=moe, steps=steps, loops=loops,
            numerics=numerics, train=train)


def main(argv):
  del argv
  unknown = set(_PARTS.value) - set(RUNS)
  if unknown:
    raise ValueError(f"--parts: unknown {sorted(unknown)}; choose from {', '.join(RUNS)}")
  if not _OUTPUT_DIR.value:
    raise ValueError("--output_dir is required (one JSON per part is written there)")
  device = _device()
  print(json.dumps(device))
  for part in _PARTS.value:
    if not _in_time(part):
      continue
    t0 = time.perf_counter()
    try:
      result = dict(device, ok=True, **RUNS[part]())
    except Exception as e:  # one part's failure must not cost the others' device time
      result = dict(device, ok=False, error=f"{type(e).__name__}: {e}"[:4000])
      print(f"{part}: FAILED {result['error']}")
    result["part_s"] = time.perf_counter() - t0
    files.write_json(str(Path(_OUTPUT_DIR.value) / f"{part}.json"),
                     json.loads(json.dumps(result, default=str)))
    if part == "loops" and result["ok"]:
      files.write_atomic(str(Path(_OUTPUT_DIR.value) / "loops.md"),
                         loops_markdown(result).encode())
    print(f"{part}: {result['part_s']:.0f} s, written")


if __name__ == "__main__":
  errors.run(main)
