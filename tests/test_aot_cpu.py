"""experiments.aot on the CPU backend (no libtpu): the report it writes, and its input errors.

On a backend without on-chip memory the independent HBM count of the optimized HLO must agree
with XLA's own bytes accessed; the bad inputs must fail with a message that says what to change.
"""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from cure_jax.analysis import random_models

REPO = Path(__file__).resolve().parents[1]
ARCH = random_models.Arch(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                          draft_layers=1, block_size=4, target_layer_ids=(0, 1))


def _run(tmp_path, *flags):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  return subprocess.run([sys.executable, "-m", "experiments.aot", "--config=configs/qwen3_8b.py",
                         "--config.dtype=float32", f"--target={tmp_path / 'target'}",
                         f"--drafter={tmp_path / 'drafter'}", "--max_len=128",
                         "--prompt_len=16", f"--output={tmp_path / 'out'}", *flags],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


@pytest.fixture
def pair_dirs(tmp_path):
  for name, cfg in zip(("target", "drafter"),
                       random_models.hf_configs(ARCH.target_cfg(), ARCH.drafter_cfg())):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(cfg))
  return tmp_path


def test_report_on_the_cpu_backend(pair_dirs):
  child = _run(pair_dirs, "--topology=cpu", "--methods=ar,cure", "--v_max=8", "--batch=2")
  assert child.returncode == 0, child.stderr[-3000:]
  data = json.loads((pair_dirs / "out.json").read_text())
  records = {r["case"]: r for r in data["records"]}
  assert set(records) == {"forward/ar/b2", "prefill/ar/b2", "decode/ar/b2", "prefill/cure/v8/b2",
                          "decode/cure/v8/b2"}
  md = (pair_dirs / "out.md").read_text()
  assert "decode/cure/v8/b2" in md and "HBM / chain min" in md
  for rec in records.values():
    it = rec["iteration"]
    assert it["on_chip_bytes_skipped"] == 0
    if rec["program"] == "forward":   # straight-line: XLA's count and ours see the same ops
      # (XLA counts whole operands where ours counts the slices read: ours is below, not far)
      assert 0.8 * rec["xla_bytes_accessed"] <= it["hbm_bytes"] <= rec["xla_bytes_accessed"]
  dec = records["decode/ar/b2"]
  assert dec["donated_state_aliased"]
  assert dec["iteration"]["by_label"]["target_weights"] > 0
  assert dec["weights"]["target_kv"] == 2 * 4 * ARCH.layers * 2 * 128 * ARCH.kv_heads * 16


@pytest.mark.parametrize("flags, message", [
    (("--topology=cpu", "--methods=ar,beam"), r"--methods: unknown \['beam'\]"),
    (("--topology=cpu", "--config.mesh.model=3"), r"mesh.data \* mesh.model = 1 \* 3"),
    (("--topology=cpu", "--prompt_len=200"), "must be below --max_len"),
    (("--topology=cpu", "--config.dtype=float16"), "dtype='float16'"),
    (("--topology=h100",), r"needs XLA's GPU compiler: .*jax\[cuda12\]"),  # not in this python
    (("--topology=cpu", "--compiler_options=xla_no_such_option=1"),
     r"error: compiler options .*No such compile option: 'xla_no_such_option'"),
    (("--topology=cpu", "--compiler_options=split_k"), "error: compiler_options takes name=value"),
    (("--topology=cpu", "--methods=chain", "--config.drafter.vocab=64"),
     r"drafter.vocab=64: no token counts at .*drafter/token_counts.npz.*--synthetic_vocab"),
])
def test_bad_inputs_are_named(pair_dirs, flags, message):
  child = _run(pair_dirs, *flags)
  assert child.returncode != 0
  assert re.search(message, child.stderr), child.stderr[-2000:]


def test_libtpu_held_by_another_process_is_not_an_unknown_topology(tmp_path, monkeypatch):
  """libtpu's failure when another process holds its lock file reads as that: the holder (a
  child holding a stand-in lock file) named, what to do, and which file; not "unknown TPU
  topology" with libtpu's advice to delete the file under a live process."""
  from jax.experimental import topologies
  from cure_jax.costs import gpu_targets
  lockfile = tmp_path / "libtpu_lockfile"
  message = ("ABORTED: Internal error when accessing libtpu multi-process lockfile. Run "
             f'"$ sudo rm {lockfile}".')   # libtpu's words (jax 0.10.2, libtpu 0.0.x)

  def taken(name, platform):
    raise RuntimeError(message)

  monkeypatch.setitem(sys.modules, "libtpu", type(sys)("libtpu"))   # installed or not
  monkeypatch.setattr(topologies, "get_topology_desc", taken)
  holder = subprocess.Popen([sys.executable, "-c", "import sys; f = open(sys.argv[1], 'w'); "
                             "print('holding', flush=True); sys.stdin.read()", str(lockfile)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  try:
    assert holder.stdout.readline() == "holding\n"
    with pytest.raises(ValueError) as e:
      gpu_targets.topology_devices("v5e:2x2")
  finally:
    holder.communicate("")
  said = str(e.value)
  assert said.startswith(f"libtpu is in use by another process (pid {holder.pid}): ")
  assert f"lock file {lockfile}" in said and "Wait for that process to end, or stop it" in said
  assert "unknown TPU topology" not in said


def test_a_synthetic_draft_vocabulary_is_counted_and_labelled(pair_dirs):
  """--synthetic_vocab: N seeded-random ids for a compile-only count; the chain minimum's extra
  head read is N of the head's rows, and the report says where the ids came from."""
  child = _run(pair_dirs, "--topology=cpu", "--methods=chain", "--batch=1", "--programs=decode",
               "--config.drafter.vocab=64", "--synthetic_vocab")
  assert child.returncode == 0, child.stderr[-3000:]
  data = json.loads((pair_dirs / "out.json").read_text())
  assert data["meta"]["draft_vocab"] == 64 and "synthetic" in data["meta"]["draft_vocab_ids"]
  w = data["meta"]["weights"]
  assert w["draft_head"] == pytest.approx(w["lm_head"] * 64 / ARCH.vocab)
  rec = data["records"][0]
  assert rec["bounds"]["chain_minimum"] == pytest.approx(
      w["target"] + w["target_kv"] + w["drafter"] + w["draft_head"] + w["drafter_kv"])
  assert "Draft vocabulary: 64 tokens (synthetic" in (pair_dirs / "out.md").read_text()


_FAIL_PREFILL = """
import sys
import jax
from absl import app
from cure_jax.runtime import errors, xla_options
from experiments import aot
real = xla_options.compile_with
def compile_with(lowered, options=None):   # the decode loop "does not fit", as v5e said at 32k
  if "@jit_run" in lowered.as_text()[:1000]:
    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: XLA:TPU compile permanent error. "
                                     "HLO temporaries (39.43G) exceeds available HBM (15.75G)")
  return real(lowered, options)
xla_options.compile_with = compile_with
app.run(errors.cli(aot.main))
"""


def test_a_program_that_does_not_fit_is_recorded_and_the_run_goes_on(pair_dirs):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  child = subprocess.run(
      [sys.executable, "-c", _FAIL_PREFILL, "--config=configs/qwen3_8b.py",
       "--config.dtype=float32", f"--target={pair_dirs / 'target'}",
       f"--drafter={pair_dirs / 'drafter'}", "--max_len=128", "--prompt_len=40",
       "--config.prefill_chunk=16", "--topology=cpu", "--methods=ar,chain", "--batch=1",
       "--programs=decode,prefill", f"--output={pair_dirs / 'out'}"],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert child.returncode == 0, child.stderr[-3000:]
  records = {r["case"]: r for r in json.loads((pair_dirs / "out.json").read_text())["records"]}
  assert set(records) == {"prefill/ar/b1", "decode/ar/b1", "prefill/chain/b1", "decode/chain/b1"}
  for name in ("decode/ar/b1", "decode/chain/b1"):
    assert records[name]["failed"] and "exceeds available HBM" in records[name]["error"]
    assert records[name]["bytes_asked"] == pytest.approx(39.43 * 2 ** 30)
    assert records[name]["bytes_available"] == pytest.approx(15.75 * 2 ** 30)
  md = (pair_dirs / "out.md").read_text()
  assert "Did not compile:" in md and "- decode/chain/b1: asked 42,337.6 MB of 16,911.4 MB of hbm" in md
  # the prefill of 40 tokens in chunks of 16 is 3 chunks: one chunk's traffic x 3, and its
  # attention reads 0 + 1 + 2 cache blocks where one chunk counts 1 (of each layer's loop)
  pre = records["prefill/chain/b1"]["iteration"]
  block = pre["nested_loop_iteration_bytes"]
  assert pre["chunks"] == 3 and pre["nested_loops_without_trip_count"] == ARCH.layers
  assert block >= ARCH.layers * 2 * ARCH.kv_heads * 16 * 16 * 4   # the K and V blocks it reads
  assert pre["hbm_bytes"] == pytest.approx(3 * pre["chunk_hbm_bytes"])   # 3 blocks either way
  assert pre["by_label"]["cache_blocks_beyond_one"] == 0 and "x the chunks" in pre["rule"]


MOE = random_models.Arch(vocab=512, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                         draft_layers=1, block_size=4, target_layer_ids=(0, 1), experts=8,
                         dense_layers=(1,))


def test_a_config_sets_the_defaults_and_an_moe_pair_compiles(tmp_path):
  """configs/qwen3_coder_30b_a3b.py's `aot` fields, pointed at a small MoE pair: no flag names
  the pair, the methods, the batch or the output, yet they are the ones compiled and written."""
  for name, cfg in zip(("target", "drafter"),
                       random_models.hf_configs(MOE.target_cfg(), MOE.drafter_cfg())):
    (tmp_path / name).mkdir()
    (tmp_path / name / "config.json").write_text(json.dumps(cfg))
  (tmp_path / "small.py").write_text(
      "from configs import qwen3_coder_30b_a3b\n\n\ndef get_config():\n"
      "  config = qwen3_coder_30b_a3b.get_config()\n"
      f"  config.aot.update(target={str(tmp_path / 'target')!r}, "
      f"drafter={str(tmp_path / 'drafter')!r}, topology='cpu', methods='ar,chain', batch='1', "
      f"output={str(tmp_path / 'out')!r})\n"
      "  return config\n")
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  child = subprocess.run([sys.executable, "-m", "experiments.aot",
                          f"--config={tmp_path / 'small.py'}", "--config.dtype=float32",
                          "--max_len=128", "--prompt_len=16", "--programs=decode"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
  assert child.returncode == 0, child.stderr[-3000:]
  data = json.loads((tmp_path / "out.json").read_text())
  assert data["meta"]["target"] == str(tmp_path / "target")
  assert [r["case"] for r in data["records"]] == ["decode/ar/b1", "decode/chain/b1"]
  assert all(r["iteration"]["by_label"]["target_weights"] > 0 for r in data["records"])


def _run_train(tmp_path, *flags):
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
  return subprocess.run([sys.executable, "-m", "experiments.aot", "--config=configs/train/tiny.py",
                         "--programs=train", "--topology=cpu", f"--target={tmp_path / 'target'}",
                         "--config.model.target_layer_ids=(0, 1)", "--train_len=24",
                         f"--output={tmp_path / 'train'}", *flags],
                        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_the_training_step_compiles_and_counts_on_the_cpu_backend(pair_dirs):
  """The online training step of the tiny recipe: what it holds, the FLOPs it executes (its
  dots, the target's 24-token chunk included) against the useful ones counted from shapes,
  which cannot exceed them, and a projected step no shorter than any one of its floors."""
  child = _run_train(pair_dirs, "--config.train.target_chunk=8")
  assert child.returncode == 0, child.stderr[-3000:]
  rec = json.loads((pair_dirs / "train.json").read_text())["records"][0]
  assert rec["program"] == "train" and rec["seq_len"] == 24 and rec["chips"] == 1
  assert rec["argument_bytes"] > 0 and rec["per_chip_bytes"] >= rec["argument_bytes"]
  assert rec["hbm_by_label"]["target_weights"] > 0 and rec["hbm_by_label"]["optimizer"] > 0
  assert rec["model_flops"]["total"] <= rec["dot_flops_per_chip"] <= 3 * rec["model_flops"]["total"]
  assert rec["step_s"] == max(rec["flop_s"], rec["hbm_s"], rec["collective_s"])
  assert 0 < rec["mfu"] <= 1 and rec["collective_bytes"] == {}


@pytest.mark.parametrize("config, programs, message", [
    ("configs/qwen3_8b.py", "train", "train goes alone, with a drafter training config"),
    ("configs/train/tiny.py", "train,decode", "train goes alone"),
])
def test_train_program_bad_inputs_are_named(pair_dirs, config, programs, message):
  child = subprocess.run([sys.executable, "-m", "experiments.aot", f"--config={config}",
                          f"--programs={programs}", "--topology=cpu",
                          f"--target={pair_dirs / 'target'}"],
                         cwd=REPO, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                         capture_output=True, text=True, timeout=300)
  assert child.returncode != 0
  assert re.search(message, child.stderr), child.stderr[-2000:]
