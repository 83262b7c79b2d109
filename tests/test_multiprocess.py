"""Several processes as one JAX job, on this machine: 2 processes x 4 fake CPU devices started by
experiments.launch, as a pod's hosts would be. Decoding gives exactly the single-process tokens
with the mesh split either way; data-parallel training equals the single-process step and
resumes bitwise in a fresh job; a process that dies, fails or never starts, and processes given
different configs, end the job quickly with a line naming the culprit, and nothing is written."""

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cure_jax.analysis import random_models
from cure_jax.runtime import distributed
from cure_jax.runtime.generation import Generator
from experiments import launch

REPO = Path(__file__).resolve().parents[1]
ARCH = random_models.Arch(vocab=16, hidden=64, heads=8, kv_heads=8, head_dim=8)  # splits 8 ways
MAX_NEW = 12


def _env() -> dict:
  return {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def _launch(argv, processes=2, devices=4, grace=60.0, timeout=540.0):
  """(status, output, seconds) of a launched job."""
  out, t0 = io.StringIO(), time.monotonic()
  status = launch.launch(argv, processes, devices, grace=grace, timeout=timeout, env=_env(),
                         out=out)
  return status, out.getvalue(), time.monotonic() - t0


@pytest.fixture(scope="module")
def decode_world(tmp_path_factory):
  root = tmp_path_factory.mktemp("mp_decode")
  target, drafter = random_models.pair(ARCH, 3)
  target_dir, drafter_dir = random_models.write_hf(root, target, drafter)
  prompts = random_models.prompts(3, ARCH.vocab, 4, lo=3, hi=10)
  (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n"
                                              for p in prompts))
  ref = Generator(target, method="ar", max_new_tokens=MAX_NEW).generate(prompts)
  return root, target_dir, drafter_dir, [r.output_ids for r in ref]


def _decode_args(root, target_dir, drafter_dir, method, data, model, out, *extra):
  return ["experiments.decode", "--config=configs/smollm2_135m.py",
          f"--config.target.path={target_dir}", f"--config.drafter.path={drafter_dir}",
          f"--config.prompts={root / 'prompts.jsonl'}", f"--config.method={method}",
          f"--config.max_new_tokens={MAX_NEW}", "--config.ignore_eos=true",
          "--config.check_ar=false", "--config.batch_size=4", "--config.compilation_cache=off",
          "--config.drafter.vocab=0",   # a random drafter: no token counts beside it
          f"--config.mesh.data={data}", f"--config.mesh.model={model}",
          # prompts of 3..10 tokens in 1..3 chunks, against one process prefilling in one step
          "--config.prefill_chunk=4",
          "--config.mesh.distributed=true", f"--config.output={out}", *extra]


@pytest.mark.parametrize("data, model", [(2, 4), (1, 8)], ids=["data_across", "model_across"])
@pytest.mark.parametrize("method", ["ar", "chain", "cure", "ddtree"])
def test_decoding_across_processes_equals_one_process(decode_world, method, data, model):
  root, target_dir, drafter_dir, want = decode_world
  out = root / f"{method}_{data}x{model}.json"
  status, log, _ = _launch(_decode_args(root, target_dir, drafter_dir, method, data, model, out))
  assert status == 0, log[-6000:]
  got = [r["output_ids"] for r in json.loads(out.read_text())["results"]]
  assert got == want
  # both processes decoded (and agreed on the results); only process 0 wrote
  assert [line.split()[0] for line in log.splitlines() if " wrote " in line] == ["[p0]"], log


def test_auto_across_processes_shares_process_0s_cost_curve(decode_world, tmp_path, monkeypatch):
  """The processes time the cost curve; all compile process 0's, so the loop is one program
  (the controlled loop even where the curve says target-only would do: fallback off)."""
  monkeypatch.setenv("CURE_JAX_CACHE", str(tmp_path))   # an empty cache: the curve is timed
  root, target_dir, drafter_dir, want = decode_world
  out = root / "auto_2x4.json"
  status, log, _ = _launch(_decode_args(root, target_dir, drafter_dir, "auto", 2, 4, out,
                                        "--config.auto.budgets=1,3,6", "--config.cure.topk=3",
                                        "--config.auto.fallback=false",   # the loop, whatever the costs
                                        f"--config.compilation_cache={tmp_path / 'xla'}"))
  assert status == 0, log[-6000:]
  assert [r["output_ids"] for r in json.loads(out.read_text())["results"]] == want
  assert "timing the auto costs" in log, log


@pytest.fixture(scope="module")
def train_world(tmp_path_factory):
  from tests.test_train_drafter import SPEC, _write_data
  from tests.dflash_reference import build_pair
  root = tmp_path_factory.mktemp("mp_train")
  pair = build_pair(SPEC, root / "pair")
  assert pair.target_dir == root / "pair" / "target"
  _write_data(pair.target_dir, root / "data_0")
  shutil.copytree(root / "data_0", root / "data_1")   # each host its own folder
  return root


def _flat(trainer) -> dict:
  from flax import nnx
  return {"/".join(map(str, p)): np.asarray(v.get_value())
          for p, v in nnx.to_flat_state(trainer.state["params"])}


def test_training_across_processes(train_world):
  from tests import multiprocess_train
  from cure_jax.training import trainer as drafter_training
  root = train_world
  status, log, _ = _launch(["tests.multiprocess_train", str(root), "first"])
  assert status == 0, log[-6000:]
  status, log2, _ = _launch(["tests.multiprocess_train", str(root), "resume"])
  assert status == 0, log2[-6000:]

  # data parallel over 2 processes == one process fed the same global batch (both halves)
  config = multiprocess_train.config(root, "reference", lr=1e-3)
  config.mesh.distributed = False
  config.data.folders = (str(root / "data_0"),)
  single = drafter_training.Trainer(config)
  losses = []
  for step in range(2):
    halves = [single.batch(step, process, 2) for process in range(2)]
    width = max(h["features"].shape[1] for h in halves)   # the job pads to the longest host's
    for h in halves:
      h["features"] = np.pad(h["features"], ((0, 0), (0, width - h["features"].shape[1]), (0, 0)))
    losses.append(single.take_step({k: np.concatenate([h[k] for h in halves]) for k in halves[0]})
                  ["loss"])
  dp = np.load(root / "dp_steps.npz")
  np.testing.assert_allclose(dp["__losses"], losses, rtol=0, atol=1e-5)
  for name, value in _flat(single).items():
    np.testing.assert_allclose(dp[name], value, rtol=0, atol=5e-5, err_msg=name)

  # a fresh job resumes the job's checkpoint bitwise; the export was written once, whole
  resumed, one_go = np.load(root / "resumed.npz"), np.load(root / "one_go.npz")
  assert sorted(resumed.files) == sorted(one_go.files)
  for name in one_go.files:
    assert np.array_equal(resumed[name], one_go[name]), name
  assert sorted(p.name for p in (root / "export").iterdir()) == [
      "config.json", "model.safetensors", "training.json"]
  assert [line.split()[0] for line in log.splitlines() if "exported step" in line] == ["[p0]"]
  assert not [p for p in root.iterdir() if p.name.startswith(".export")]  # no staging left


@pytest.mark.parametrize("mode", ["kill", "raise"])
def test_a_lost_process_ends_the_job_naming_it(mode):
  status, log, seconds = _launch(["tests.multiprocess_fault", mode], devices=2, timeout=120)
  assert status != 0 and seconds < 90, (status, seconds, log[-4000:])
  p0 = [line for line in log.splitlines() if line.startswith("[p0] [process 0]")]
  expect = "stopped answering" if mode == "kill" else "failed"
  assert p0 and "process 1 of 2" in p0[-1] and expect in p0[-1], log[-4000:]
  assert "p0=3" in log   # process 0 ended itself (distributed.EXIT_PEER_LOST), not the launcher


def test_a_process_that_never_starts_is_named(decode_world, tmp_path):
  root, target_dir, drafter_dir, _ = decode_world
  out = tmp_path / "never.json"
  env = launch.process_env(_env(), f"127.0.0.1:{launch.free_port()}", 2, 0, 4)
  t0 = time.monotonic()
  child = subprocess.run([sys.executable, "-m", *_decode_args(
      root, target_dir, drafter_dir, "chain", 2, 4, out, "--config.mesh.timeout_s=5")],
      cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
  assert child.returncode == distributed.EXIT_PEER_LOST, child.stderr[-3000:]
  assert time.monotonic() - t0 < 60
  assert "process 1 never joined within mesh.timeout_s=5 s" in child.stderr
  assert not out.exists()


def test_processes_given_different_configs_stop_before_decoding(decode_world, tmp_path):
  root, target_dir, drafter_dir, _ = decode_world
  other = tmp_path / "other.jsonl"
  other.write_text('{"prompt_ids": [1, 2, 3]}\n')
  out = tmp_path / "differ.json"
  address = f"127.0.0.1:{launch.free_port()}"
  children = []
  for pid, extra in ((0, []), (1, [f"--config.prompts={other}", "--config.max_new_tokens=9"])):
    args = _decode_args(root, target_dir, drafter_dir, "chain", 2, 4, out) + extra
    children.append(subprocess.Popen([sys.executable, "-m", *args], cwd=REPO,
                                     env=launch.process_env(_env(), address, 2, pid, 4),
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
  logs = [c.communicate(timeout=300)[0] for c in children]
  for c, log in zip(children, logs):
    assert c.returncode != 0, log[-3000:]
    assert "different configs or prompts: config.max_new_tokens, config.prompts, prompts" in log, (
        log[-3000:])
  assert not out.exists()
  assert not any("decode" in line and "iteration" in line for line in logs[0].splitlines())
