"""experiments.device_costs --parts=loops on this CPU with --small: the device script a GPU runs,
tried as it will run there. One record per compiled decode loop, in the order the script
promises, each beside the count of the program that ran."""

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# --small's target (cure_jax/analysis/device_costs.py): Qwen3-8B's config.json, hidden 256,
# intermediate 512, 4 layers, 4 query and 2 key/value heads of 64, vocabulary 4096, float32
H, I, LAYERS, Q, KV, V = 256, 512, 4, 4 * 64, 2 * 64, 4096
LAYER_WEIGHTS = 4 * (H * Q * 2 + H * KV * 2 + 3 * H * I)   # bytes of one layer's matrices
HEAD = 4 * H * V


def test_loops_part_times_every_program_beside_its_count(tmp_path):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  child = subprocess.run(
      [sys.executable, "-m", "experiments.device_costs", "--small", "--parts=loops",
       "--loop_batches=1", "--tree_nodes=16", "--loop_tokens=8", f"--output_dir={tmp_path}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert child.returncode == 0, child.stderr[-3000:]
  data = json.loads((tmp_path / "loops.json").read_text())
  assert data["ok"] and "partial" not in data and data["hbm_gbps"] > 0 and data["bf16_tflops"] > 0
  records = data["records"]
  # ar, chain and ddtree also with layer_kernels off, beside the default
  assert [(r["method"], r["nodes"], r["layer_kernels"]) for r in records] == [
      ("ar", 1, True), ("ar", 1, False), ("chain", 16, True), ("chain", 16, False),
      ("ddtree", 16, True), ("ddtree", 16, False), ("cure", 64, True), ("auto", 16, True)]
  for r in records:
    assert r["batch"] == 1 and r["device"] == "cpu" and r["ms_per_iteration"] > 0
    assert r["count_ms"] > 0 and r["iterations"] >= 1
    # every iteration verifies with the whole target: its layers and head are read at least once
    assert r["hbm_bytes"] >= LAYERS * LAYER_WEIGHTS + HEAD, r
  flops = {r["method"]: r["flops"] for r in records if r["layer_kernels"]}
  # one row through the target, a 16-token block (and the drafter), a 64-node tree
  assert flops["ar"] < flops["chain"] < flops["cure"]
  assert "| ddtree | 16 | 1 |" in (tmp_path / "loops.md").read_text()


def test_numerics_part_compares_the_modes_on_the_same_prompts(tmp_path):
  """--parts=numerics: both modes decode the same 8 prompts; in numerics=invariant, ar, chain
  and ddtree at batch 8 emit each prompt's target-only tokens decoded alone (the default mode
  runs ar alone, for its time), and both modes' target-only times per token come back with
  their ratio."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  child = subprocess.run(
      [sys.executable, "-m", "experiments.device_costs", "--small", "--parts=numerics",
       "--numerics_tokens=12", f"--output_dir={tmp_path}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert child.returncode == 0, child.stderr[-3000:]
  data = json.loads((tmp_path / "numerics.json").read_text())
  assert data["ok"] and data["prompts"] == 8 and data["tokens"] == 12
  assert set(data["modes"]) == {"invariant", "default"}
  assert data["modes"]["invariant"]["differ"] == {"ar": 0, "chain": 0, "ddtree": 0}
  assert set(data["modes"]["default"]["differ"]) == {"ar"}
  for mode in data["modes"].values():
    assert all(ms > 0 for ms in mode["tpot_ms"].values()) and set(mode["tpot_ms"]) == {"1", "8"}
  for batch, ratio in data["tpot_overhead"].items():
    modes = data["modes"]
    assert ratio == modes["invariant"]["tpot_ms"][batch] / modes["default"]["tpot_ms"][batch]
