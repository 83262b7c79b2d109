"""Step costs on an accelerator with Qwen3-8B shapes and random bf16 weights.

Prints the verification cost curve C_v(n) (ms per target forward over n tree nodes), the DFlash
draft cost C_d (one block, and the repair re-draft of R blocks), and the compiled-loop time per
iteration of ar, chain and cure, then the roofline: the 8B target's bf16 weights are ~16.4 GB,
so at the device's memory bandwidth one forward cannot take less than bytes / bandwidth.
Random weights make tau meaningless; the per-iteration costs are what this measures.

  python -m experiments.device_costs --output=results/device_costs.json          # GPU / TPU
  python -m experiments.device_costs --small --output=/tmp/costs.json            # CPU check
"""

import dataclasses
import json
import time

import jax
import jax.numpy as jnp
from absl import app, flags
from flax import nnx

from cure_jax.runtime import errors, pipeline
from cure_jax.tree import repair
from cure_jax.runtime.generation import Generator
from cure_jax.models.dflash import DFlash, DFlashConfig
from cure_jax.models.layers import Rope
from cure_jax.models.qwen3 import ModelConfig, Qwen3
from cure_jax.costs import efficiency

_SMALL = flags.DEFINE_bool("small", False, "a scaled-down model (for a CPU check of the script)")
_BANDWIDTH = flags.DEFINE_float("bandwidth_gbs", 4800.0, "device memory bandwidth, GB/s (H200: "
                                "4800)")
_CONTEXT = flags.DEFINE_integer("context", 512, "committed tokens before the tree")
_MAX_NEW = flags.DEFINE_integer("max_new_tokens", 64, "tokens per loop timing")
_OUTPUT = flags.DEFINE_string("output", "", "JSON path")
_PROJECTION = flags.DEFINE_string("projection", "", "experiments.projection JSON: print the "
                                  "projected ms per iteration of this device beside the measured")

# jax device_kind prefixes -> cure_jax.costs.roofline.DEVICES keys
_KINDS = (("TPU v5 lite", "v5e"), ("TPU v5e", "v5e"), ("TPU v6", "v6e"), ("TPU v5", "v5p"),
          ("NVIDIA A100", "A100"), ("NVIDIA H100", "H100"), ("NVIDIA H200", "H200"),
          ("NVIDIA B200", "B200"))


def beside_projection(loops: dict, path: str) -> list[str]:
  """Lines comparing the measured loop ms per iteration with the projection for this device
  (batch 1, the paper's τ rows; the projection assumes its own max_len)."""
  kind = jax.devices()[0].device_kind
  key = next((k for prefix, k in _KINDS if kind.startswith(prefix)), None)
  rows = json.loads(open(path).read())["rows"]
  mine = [r for r in rows if r["device"].split(" ")[0] == key and r["batch"] == 1
          and r["tau_from"] == "paper"]
  if not mine:
    return [f"no projection rows for device {kind!r} (key {key}) in {path}"]
  out = []
  for method, loop in loops.items():
    proj = [r for r in mine if r["method"] == method]
    if proj:
      r = max(proj, key=lambda r: r["v_max"])
      out.append(f"{method}: measured {loop['ms_per_iteration']:.2f} ms / iteration, projected "
                 f"{r['iteration_ms']:.2f} ms (v_max {r['v_max']}, roofline of the AOT count)")
  return out

QWEN3_8B = ModelConfig("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, 1e-6,
                       Rope(128, 1_000_000.0), False)
DFLASH_8B = DFlashConfig(4096, 12288, 5, 32, 8, 128, 1e-6, Rope(128, 1_000_000.0), 16, 151669,
                         (1, 9, 17, 25, 33), 36)


def _configs():
  if not _SMALL.value:
    return QWEN3_8B, DFLASH_8B
  target = dataclasses.replace(QWEN3_8B, vocab_size=4096, hidden_size=256, intermediate_size=512,
                               num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                               rope=Rope(64, 1e6))
  drafter = dataclasses.replace(DFLASH_8B, hidden_size=256, intermediate_size=512, num_layers=1,
                                num_heads=4, num_kv_heads=2, head_dim=64, rope=Rope(64, 1e6),
                                mask_token_id=4095, target_layer_ids=(1, 2), num_target_layers=4)
  return target, drafter


def _loop_ms_per_iteration(target, drafter, method, prompt_len):
  cure = repair.RepairConfig(tau_margin=1e9, max_depth=drafter.cfg.block_size - 1, v_max=64)
  gen = Generator(target, drafter, method=method, max_new_tokens=_MAX_NEW.value,
                  cure=cure if method == "cure" else None)
  prompt = list(range(10, 10 + prompt_len))
  gen.generate([prompt])  # compile + warm-up
  r = gen.generate([prompt])[0]
  return 1000.0 * r.decode_s / max(r.iterations, 1), sum(gen.compile_s.values())


def main(argv):
  del argv
  tcfg, dcfg = _configs()
  t0 = time.perf_counter()
  target = Qwen3(tcfg, jnp.bfloat16, rngs=nnx.Rngs(0))
  drafter = DFlash(dcfg, jnp.bfloat16, rngs=nnx.Rngs(1))
  init_s = time.perf_counter() - t0
  n_bytes = sum(x.nbytes for x in jax.tree.leaves(nnx.state(target)))
  costs = efficiency.measure(target, drafter, context=_CONTEXT.value, num_paths=5,
                             feature_layers=dcfg.feature_layers)
  loops = {}
  for method in ("ar", "chain", "cure"):
    ms, compile_s = _loop_ms_per_iteration(target, drafter, method, 64)
    loops[method] = dict(ms_per_iteration=ms, compile_s=compile_s)
  floor_ms = n_bytes / (_BANDWIDTH.value * 1e9) * 1e3
  result = dict(target_bytes=n_bytes, init_s=init_s,
                roofline_ms_per_forward=floor_ms, bandwidth_gbs=_BANDWIDTH.value, **costs,
                loop=loops)
  print(json.dumps(result, indent=1, default=str))
  print(f"C_v(1) = {costs['verify_ms'][1]:.2f} ms vs roofline {floor_ms:.2f} ms "
        f"({floor_ms / costs['verify_ms'][1]:.0%} of peak bandwidth); "
        f"C_v(64)/C_v(1) = {costs['verify_ms'][64] / costs['verify_ms'][1]:.2f}")
  if _PROJECTION.value:
    print("\n".join(beside_projection(loops, _PROJECTION.value)))
  if _OUTPUT.value:
    pipeline.write_json(_OUTPUT.value, json.loads(json.dumps(result, default=str)))


if __name__ == "__main__":
  app.run(errors.cli(main))
