"""The drafter trainer (cure_jax/training/trainer.py) on configs/train/tiny.py.

A random 4-layer Qwen3 target (saved by transformers) and shards of its own greedy
continuations are built once per module; the tiny config trains on them in seconds. The
data-parallel check needs 8 devices: as in test_sharding.py, one test re-runs it in a child
process whose XLA_FLAGS ask for 8 fake CPU devices.
"""

import json
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
from dflash.model import DFlashDraftModel
from flax import nnx
from transformers import Qwen3ForCausalLM

from configs.train import tiny
from cure_jax.checkpoints.qwen3 import load_target
from cure_jax.training import data as drafter_data, objective, trainer as drafter_training
from tests.dflash_reference import PairSpec, build_pair, reference_block_logits
from tests.fake_devices import run_in_child

DEVICES = 8
SPEC = PairSpec(vocab_size=96, hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=12,
                target_layers=4, target_layer_ids=(1, 3), block_size=4, seed=3)
SEQS, NEW = 12, 20   # sequences, greedy tokens after each prompt (fewer if it stops)


def _write_data(target_dir: Path, out: Path) -> None:
  """SEQS random prompts with the target's greedy continuations, through the data stage's own
  generator (drafter_data.run)."""
  target = load_target(target_dir, jnp.float32, progress=False)
  rng = np.random.default_rng(0)
  rows = [dict(uid=r, prompt_ids=rng.integers(0, SPEC.vocab_size - 1, int(n)).tolist())
          for r, n in enumerate(rng.integers(4, 9, SEQS))]
  drafter_data.run(target, None, rows, out=out, target_dir=str(target_dir),
                   target_layer_ids=SPEC.target_layer_ids, stops=(SPEC.vocab_size - 1,),
                   batch_size=SEQS, max_new_tokens=NEW, prompt_buckets=(8,), log=lambda *_: None)


@pytest.fixture(scope="module")
def world(tmp_path_factory):
  root = tmp_path_factory.mktemp("train")
  pair = build_pair(SPEC, root)
  _write_data(pair.target_dir, root / "data")
  return types.SimpleNamespace(root=root, target_dir=pair.target_dir, data=root / "data")


def make_config(world, name: str, **overrides):
  config = tiny.get_config()
  config.target.path = str(world.target_dir)
  config.data.folders = (str(world.data),)
  config.workdir = str(world.root / name)
  for key, value in overrides.items():
    section, field = key.split("__")
    config[section][field] = value
  return config


def flat(params) -> dict:
  return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(params)}


@pytest.fixture(scope="module")
def trained(world):
  """The tiny config trained to its end in one go."""
  trainer = drafter_training.Trainer(make_config(world, "one_go"))
  trainer.run()
  return trainer


def test_loss_goes_down_on_a_memorisable_set(trained):
  losses = [r["loss"] for r in trained.history if "loss" in r]
  assert len(losses) == tiny.get_config().train.steps
  assert np.mean(losses[-3:]) < 0.8 * np.mean(losses[:3]), losses   # measured: 0.73
  evals = [r for r in trained.history if "eval_tau" in r]               # held out: measured only
  assert [r["step"] for r in evals] == [0, 6, 12]
  assert all(1 <= r["eval_tau"] <= tiny.get_config().model.block_size for r in evals)


def test_export_loads_in_the_reference_and_matches_its_block_logits(world, trained):
  """The dflash wheel reads our export; its block logits equal our training forward's."""
  out = trained.export(str(world.root / "export"))
  config = json.loads((out / "config.json").read_text())
  assert config["dflash_config"] == dict(mask_token_id=95, target_layer_ids=[1, 3])
  wheel = DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval()
  target = Qwen3ForCausalLM.from_pretrained(world.target_dir, dtype=torch.float32).eval()
  pair = types.SimpleNamespace(target=target, drafter=wheel)
  data, k = trained.data, trained.cfg.block_size
  drafter = nnx.merge(trained.graphdef, trained.state["params"])
  for i, p in ((int(data.eval_idx[0]), 9), (int(data.train_idx[0]), 14)):
    s = data.starts[i]
    feats = np.asarray(data.features[s:s + p], np.float32)[None]           # [1, p, F]
    block = np.full((1, 1, k), trained.cfg.mask_token_id, np.int32)
    block[0, 0, 0] = data.tokens[s + p]
    hidden = objective.train_forward(drafter, trained.embed, jnp.asarray(feats),
                                     jnp.asarray(block), jnp.asarray([[p]]))
    ours = np.asarray(objective.block_logits(drafter, hidden[0, 0, 1:], trained.head))
    with torch.no_grad():
      ref = reference_block_logits(pair, torch.from_numpy(feats), int(block[0, 0, 0]), k)
    np.testing.assert_allclose(ours, ref[0].numpy(), rtol=0, atol=1e-4)


def test_resume_after_interruption_equals_one_go(world, trained):
  config = make_config(world, "interrupted")
  drafter_training.Trainer(config).run(until=5)                  # then the process "dies"
  resumed = drafter_training.Trainer(make_config(world, "interrupted"))
  assert resumed.step == 5
  resumed.run()
  assert resumed.step == trained.step == config.train.steps
  got, want = flat(resumed.state["params"]), flat(trained.state["params"])
  assert got.keys() == want.keys()
  for path in want:
    assert np.array_equal(got[path], want[path]), path
  loss = lambda h: [(r["step"], r["loss"]) for r in h if "loss" in r]
  assert loss(resumed.history) == loss(trained.history)


@pytest.mark.skipif(jax.device_count() >= DEVICES, reason="this process already has the devices")
def test_on_fake_cpu_devices(tmp_path):
  out = run_in_child(__file__, "data_parallel", tmp_path, DEVICES)
  assert "1 passed" in out, out[-2000:]


@pytest.mark.skipif(jax.device_count() < DEVICES, reason="needs 8 devices: runs in the child")
def test_data_parallel_step_equals_single_device(world):
  """Batch split over 8 devices vs one: same losses, gradients (AdamW's first moment, tightly)
  and parameters. Adam moves a parameter whose gradient is near zero by ~lr x warm-up, and
  another summation order may flip that gradient's sign: with lr 1e-3 over two warm-up steps
  such a parameter may differ by ~1e-5 (seen: 1.03e-5), hence 5e-5 for the parameters."""
  single = drafter_training.Trainer(make_config(world, "dp1", mesh__data=1, train__lr=1e-3))
  split = drafter_training.Trainer(make_config(world, "dp8", mesh__data=DEVICES,
                                               train__lr=1e-3))
  batch = split._put(split.batch(0))
  assert batch["features"].sharding.spec[0] == "data"
  assert len(batch["features"].addressable_shards) == DEVICES
  for _ in range(2):
    a, b = single.take_step(), split.take_step()
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=0, atol=1e-5)
  leaf = jax.tree.leaves(split.state["params"])[0]
  assert len(leaf.sharding.device_set) == DEVICES and leaf.sharding.is_fully_replicated
  for tree, atol in ((lambda t: t.state["params"], 5e-5),
                     (lambda t: optax.tree_utils.tree_get(t.state["opt_state"], "mu"), 1e-6)):
    got, want = flat(tree(split)), flat(tree(single))
    assert got.keys() == want.keys()
    for path in want:
      np.testing.assert_allclose(got[path], want[path], rtol=0, atol=atol, err_msg=str(path))


@pytest.mark.parametrize("overrides, error, match", [
    (dict(model__block_size=1), ValueError, "block_size=1 < 2"),
    (dict(train__loss_positions=4), ValueError, "loss_positions=4"),
    (dict(model__target_layer_ids=(0, 3)), ValueError, r"target_layer_ids \[1, 3\].*\[0, 3\]"),
    (dict(model__init_from=3), ValueError, "init_from=3"),
    (dict(model__mask_token_id=96), ValueError, "mask_token_id 96"),
    (dict(model__dtype="float64"), ValueError, "model.dtype='float64'"),
    (dict(data__folders=("/nonexistent/drafter_data",)), FileNotFoundError,
     "/nonexistent/drafter_data"),
])
def test_bad_input_is_named(world, overrides, error, match):
  with pytest.raises(error, match=match):
    drafter_training.Trainer(make_config(world, "bad", **overrides))
