"""What a decoding step costs on the accelerator this runs on, with the real models' shapes and
random bf16 weights (random weights make τ meaningless; costs are what this measures): the
parts of `experiments.device_costs`, each a dict written as <output_dir>/<part>.json. No part,
batch, chunk or node count starts after the deadline, so a lease's end loses nothing measured.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cure_jax.analysis import random_models
from cure_jax.checkpoints import dflash as convert_dflash, qwen3 as convert_qwen3
from cure_jax.checkpoints.store import read_hf_config
from cure_jax.costs import efficiency, hlo_traffic
from cure_jax.models.kernels import gpu_layer
from cure_jax.runtime import cost_curve, decoding, files
from cure_jax.runtime.generation import Generator, decoding_spec
from cure_jax.training import objective, program
from cure_jax.tree import controller, repair


@dataclasses.dataclass(frozen=True)
class Settings:
  """experiments.device_costs' flags; train_config: configs/train/qwen3_8b.py's config (the
  train part's), read by the entry point (configs sit above the library)."""
  output_dir: str
  small: bool
  batches: tuple[int, ...]
  budgets: tuple[int, ...]
  max_len: int
  prompt_len: int
  chunks: tuple[int, ...]
  nodes: tuple[int, ...]
  target: str
  drafter: str
  moe: str
  loop_batches: tuple[int, ...]
  tree_nodes: tuple[int, ...]
  loop_tokens: int
  train_rows: tuple[int, ...]
  train_len: int
  numerics_tokens: int
  train_config: Any = None
  deadline_s: float = 1e9
  start: float = dataclasses.field(default_factory=time.perf_counter)

  def in_time(self, what: str) -> bool:
    """False (and says so) once deadline_s has passed since start: `what` is not started."""
    if time.perf_counter() - self.start <= self.deadline_s:
      return True
    print(f"{what}: skipped (past --deadline_s={self.deadline_s:.0f})")
    return False


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


def _config(s: Settings, path: str, sizes: dict | None = None) -> dict:
  """path's config.json, scaled to `sizes` (to _SMALL_SIZES with --small); a scaled drafter has
  one layer reading target layers 1 and 2."""
  config = read_hf_config(path)
  sizes = _SMALL_SIZES if s.small else sizes
  if not sizes:
    return config
  config = {**config, **{k: v for k, v in sizes.items() if k in config}}
  if "dflash_config" in config:
    config["num_hidden_layers"] = 1
    config["dflash_config"] = dict(config["dflash_config"], mask_token_id=sizes["vocab_size"] - 1,
                                   target_layer_ids=[1, 2])
  return config


def _dtype(s: Settings):
  """bf16 as on accelerators; float32 for --small (the CPU backend has no bf16 dot thunks)."""
  return jnp.float32 if s.small else jnp.bfloat16


def _pair(s: Settings):
  """Qwen3-8B and its DFlash drafter with random weights, built on the default device."""
  dtype = _dtype(s)
  target = convert_qwen3.FAMILY.build(_config(s, s.target), dtype)
  drafter = convert_dflash.FAMILY.build(_config(s, s.drafter), dtype)
  return target, drafter


def smoke(s: Settings) -> dict:
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


def curve(s: Settings) -> dict:
  """cost_curve.time_budgets at each batch: the seconds auto's controller would use here."""
  target, drafter = _pair(s)
  auto = controller.Settings(budgets=s.budgets)
  gen = Generator(target, drafter, method="auto", max_new_tokens=64, auto=auto)
  spec = decoding_spec("auto", drafter, 64, s.max_len, block_size=gen.block_size,
                       cure=gen.cure, auto=auto)
  rows = []
  for batch in filter(lambda b: s.in_time(f"curve batch {b}"), s.batches):
    t0 = time.perf_counter()
    row = cost_curve.time_budgets(gen.graphdef, gen.params, spec, batch)
    row.update(batch=batch, wall_s=time.perf_counter() - t0)
    print(f"curve batch {batch}: draft {1e3 * row['draft_s']:.2f} ms, verify " +
          ", ".join(f"n={n} {1e3 * s:.2f}" for n, s in zip(auto.budgets, row["verify_s"])) +
          f" ms ({row['wall_s']:.0f} s with compiles)")
    rows.append(row)
  return dict(max_len=s.max_len, rows=rows)


def prefill(s: Settings) -> dict:
  """One prompt of --prompt_len tokens through chain's compiled prefill at each chunk size."""
  target, drafter = _pair(s)
  p = s.prompt_len
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, 1000, (1, p)), jnp.int32)
  rows = []
  for chunk in filter(lambda c: s.in_time(f"prefill chunk {c}"), s.chunks):
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


def moe(s: Settings) -> dict:
  """C_v(n) of the MoE target at batch 1 (ms per target forward over n chain nodes)."""
  target = convert_qwen3.FAMILY.build(_config(s, s.moe), _dtype(s))
  nbytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(target)))
  verify = {}
  for n in filter(lambda n: s.in_time(f"moe C_v({n})"), s.nodes):
    verify.update(efficiency.verify_cost(target, (n,), context=512))
    print(f"moe C_v({n}) = {verify[n]:.2f} ms")
  return dict(target_bytes=nbytes, verify_ms=verify)


def steps(s: Settings) -> dict:
  """The older measurement: C_v, C_d and loop ms per iteration (batch 1, prompt 64)."""
  target, drafter = _pair(s)
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


def gemm_tflops(small: bool = False) -> float:
  """This device's dense bf16 matmul rate: the best of 5 products of two n x n matrices (n
  1,024 when small)."""
  n = 1024 if small else 8192
  a = jnp.ones((n, n), jnp.bfloat16)
  f = jax.jit(lambda a, b: a @ b)
  jax.block_until_ready(f(a, a))
  runs = []
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(f(a, a))
    runs.append(time.perf_counter() - t0)
  return 2 * n ** 3 / min(runs) / 1e12


def copy_gbps(small: bool = False) -> float:
  """This device's HBM bandwidth: the best of 5 passes of x + 1 over a 2 GiB bf16 array (one
  read and one write of it)."""
  n = (32 if small else 1024) * 2 ** 20
  x = jnp.ones((n,), jnp.bfloat16)
  f = jax.jit(lambda x: x + 1)
  jax.block_until_ready(f(x))
  runs = []
  for _ in range(5):
    t0 = time.perf_counter()
    jax.block_until_ready(f(x))
    runs.append(time.perf_counter() - t0)
  return 2 * x.nbytes / min(runs) / 1e9


def _loop_programs(block: int, tree_nodes: tuple[int, ...]
                   ) -> list[tuple[str, int, repair.RepairConfig | None]]:
  """(method, nodes verified a row per iteration, tree settings) in the order they are timed."""
  out = [("ar", 1, None), ("chain", block, None)]
  out += [("ddtree", n, repair.RepairConfig(max_depth=block - 1, v_max=n))
          for n in tree_nodes]
  cure = repair.RepairConfig(tau_margin=1e9, max_depth=block - 1, v_max=64)  # repair every block
  return out + [("cure", 64, cure), ("auto", block, None)]


def _loop_variants(block: int, batch: int, tree_nodes: tuple[int, ...]):
  """(method, nodes, tree settings, layer_kernels) in order: ar, chain and ddtree where the
  target's layers take gpu_layer's kernels again with XLA's fusions, so that the timing decides
  between them."""
  for method, nodes, cure in _loop_programs(block, tree_nodes):
    yield method, nodes, cure, True
    if method in ("ar", "chain", "ddtree") and batch * nodes <= gpu_layer.MAX_ROWS:
      yield method, nodes, cure, False


def loops(s: Settings) -> dict:
  """ms per iteration of each compiled decode loop and its count at the measured figures."""
  gbps, tflops = copy_gbps(s.small), gemm_tflops(s.small)
  print(f"loops: HBM {gbps:.0f} GB/s (copy), bf16 GEMM {tflops:.1f} TFLOP/s")
  target, drafter = _pair(s)
  rng = np.random.default_rng(0)
  records = []
  for batch in s.loop_batches:
    prompts = rng.integers(0, 1000, (batch, 64)).tolist()
    for method, nodes, cure, kernels in _loop_variants(drafter.cfg.block_size, batch, s.tree_nodes):
      if not s.in_time(f"loops {method}/{nodes} batch {batch} layer_kernels={kernels}"):
        continue
      target.layer_kernels = kernels
      try:
        gen = Generator(target, drafter if method != "ar" else None, method=method, cure=cure,
                        max_new_tokens=s.loop_tokens)
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
      files.write_json(str(Path(s.output_dir) / "loops.json"),   # so far, in case of a kill
                       dict(device(s), partial=True, hbm_gbps=gbps, bf16_tflops=tflops,
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


def train(s: Settings) -> dict:
  """Seconds per online training step (the 3rd to 5th after compiling), tokens/s and MFU (the
  step's model FLOPs, training/program.model_flops, over the measured peak)."""
  peak = gemm_tflops(s.small)
  print(f"train: bf16 GEMM peak {peak:.1f} TFLOP/s")
  target = convert_qwen3.FAMILY.build(_config(s, s.target), jnp.bfloat16)
  config = s.train_config
  if s.small:
    config.model.update(num_layers=1, target_layer_ids=(1, 2), mask_token_id=4095)
  rows = []
  for n in filter(lambda n: s.in_time(f"train {n} rows"), s.train_rows):
    config.train.seqs_per_step = n
    static, (state, frozen, batch) = program.random_inputs(config, target, s.train_len)
    flops = program.model_flops(config, target.cfg, s.train_len)["total"]
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
    row = dict(rows=n, seq_len=s.train_len, step_s=s, runs_s=runs, compile_s=compile_s,
               tokens_per_s=n * s.train_len / s, model_flops=flops,
               mfu=flops / s / (peak * 1e12))
    rows.append(row)
    print(f"train {n} x {s.train_len}: {s:.3f} s per step, {row['tokens_per_s']:,.0f} "
          f"tokens/s, MFU {row['mfu']:.3f} of the measured peak (compile {compile_s:.0f} s)")
    break
  return dict(gemm_bf16_tflops=peak, rows=rows)


def numerics(s: Settings) -> dict:
  """numerics=invariant on this device, beside the default mode: greedy ar, chain and ddtree at
  batch 8 (the default mode: ar only, for its time) against target-only decoding of each prompt
  alone, and the target-only ms per token at batch 1 and 8 (second runs: compiled and warm)."""
  dtype = _dtype(s)
  target = convert_qwen3.FAMILY.build(_config(s, s.target, _NUMERICS_SIZES), dtype)
  drafter = convert_dflash.FAMILY.build(_config(s, s.drafter, _NUMERICS_SIZES), dtype)
  prompts = random_models.prompts(0, target.cfg.vocab_size, 8, lo=32, hi=32)   # one shape
  tokens = s.numerics_tokens
  modes = {}
  for mode in ("invariant", "default"):
    if not s.in_time(f"numerics {mode}"):
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
  return dict(sizes=_SMALL_SIZES if s.small else _NUMERICS_SIZES, dtype=str(dtype),
              prompts=len(prompts), tokens=tokens, modes=modes, tpot_overhead=overhead)


def device(s: Settings) -> dict:
  return dict(device_kind=jax.devices()[0].device_kind, backend=jax.default_backend(),
              jax=jax.__version__, small=s.small)


RUNS = dict(smoke=smoke, curve=curve, prefill=prefill, moe=moe, steps=steps, loops=loops,
            numerics=numerics, train=train)


RUNS = dict(smoke=smoke, curve=curve, prefill=prefill, moe=moe, steps=steps, loops=loops,
            numerics=numerics, train=train)


def run(parts: list[str], s: Settings) -> None:
  """Runs `parts` in order, writing each one's JSON (and loops.md) as soon as it ends; a part
  that fails is recorded as such and the next one runs."""
  unknown = set(parts) - set(RUNS)
  if unknown:
    raise ValueError(f"--parts: unknown {sorted(unknown)}; choose from {', '.join(RUNS)}")
  if not s.output_dir:
    raise ValueError("--output_dir is required (one JSON per part is written there)")
  about = device(s)
  print(json.dumps(about))
  for part in parts:
    if not s.in_time(part):
      continue
    t0 = time.perf_counter()
    try:
      result = dict(about, ok=True, **RUNS[part](s))
    except Exception as e:  # one part's failure must not cost the others' device time
      result = dict(about, ok=False, error=f"{type(e).__name__}: {e}"[:4000])
      print(f"{part}: FAILED {result['error']}")
    result["part_s"] = time.perf_counter() - t0
    files.write_json(str(Path(s.output_dir) / f"{part}.json"),
                     json.loads(json.dumps(result, default=str)))
    if part == "loops" and result["ok"]:
      files.write_atomic(str(Path(s.output_dir) / "loops.md"), loops_markdown(result).encode())
    print(f"{part}: {result['part_s']:.0f} s, written")
