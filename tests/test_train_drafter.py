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
from jax.sharding import PartitionSpec as P
from transformers import Qwen3ForCausalLM

from configs.train import tiny
from cure_jax.checkpoints.dflash import load_drafter
from cure_jax.checkpoints.qwen3 import load_target
from cure_jax.runtime.generation import Generator
from cure_jax.training import data as drafter_data, objective, responses
from cure_jax.training import trainer as drafter_training
from cure_jax.tree.sampling import Sampling
from tests.dflash_reference import (PairSpec, build_pair, reference_block_logits,
                                    reference_generate)
from tests.fake_devices import run_in_child

DEVICES = 8
SPEC = PairSpec(vocab_size=96, hidden_size=48, num_heads=4, num_kv_heads=2, head_dim=12,
                target_layers=4, target_layer_ids=(1, 3), block_size=4, seed=3)
SEQS, NEW = 12, 20   # sequences, greedy tokens after each prompt (fewer if it stops)


def _write_data(target_dir: Path, out: Path, numerics: str = "default") -> None:
  """SEQS random prompts with the target's greedy continuations, through the data stage's own
  generator (drafter_data.run)."""
  target = load_target(target_dir, jnp.float32, progress=False)
  target.numerics = numerics
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
  _write_data(pair.target_dir, root / "data_invariant", numerics="invariant")
  return types.SimpleNamespace(root=root, target_dir=pair.target_dir, data=root / "data",
                               data_invariant=root / "data_invariant")


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


def test_export_decodes_like_the_reference_on_held_out_prompts(world, trained):
  """Our chain decoder with the exported drafter emits the wheel's tokens and accepted lengths
  on the prompts of the held-out sequences."""
  out = trained.export(str(world.root / "export_chain"))
  pair = types.SimpleNamespace(
      drafter=DFlashDraftModel.from_pretrained(out, dtype=torch.float32).eval(),
      target=Qwen3ForCausalLM.from_pretrained(world.target_dir, dtype=torch.float32).eval())
  target = load_target(world.target_dir, jnp.float32, progress=False)
  drafter = load_drafter(out, jnp.float32, progress=False, target_cfg=target.cfg)
  data = trained.data
  prompts = [data.tokens[data.starts[i]:data.starts[i] + data.prompt_lens[i]].tolist()
             for i in data.eval_idx]
  results = Generator(target, drafter, method="chain", max_new_tokens=NEW).generate(prompts)
  for prompt, result in zip(prompts, results):
    ids, accept_lengths = reference_generate(pair, prompt, NEW)
    assert result.output_ids == ids
    assert result.accept_lengths == accept_lengths


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


def test_online_features_are_the_stored_ones_bitwise_and_so_is_the_loss(world):
  """With the target's numerics invariant, the features the data stage stored while decoding
  and those the online step computes by chunked prefill (chunks of 8 over 32-token contexts)
  are the same bits, and one training step gives the same loss from either."""
  common = dict(data__folders=(str(world.data_invariant),), target__numerics="invariant",
                train__target_chunk=8)
  stored = drafter_training.Trainer(make_config(world, "stored", **common))
  online = drafter_training.Trainer(make_config(world, "online", data__features="online",
                                                **common))
  a, b = stored.batch(0), online.batch(0)
  assert "features" not in b and b["tokens"].shape[1] > 8 and b["tokens"].shape[1] % 8 == 0
  got = np.asarray(objective.context_features(online.online, online.target, b))
  seen = np.arange(a["features"].shape[1])[None] < b["lengths"][:, None] - 1  # last: never fed
  assert seen.sum() > 100
  np.testing.assert_array_equal(got.view(np.uint16)[seen], a["features"].view(np.uint16)[seen])
  assert stored.take_step()["loss"] == online.take_step()["loss"]


def test_online_from_a_responses_file_has_the_folders_labels(world, tmp_path):
  """A responses file (tokens only) labels each answer token with the next one: the labels the
  folder stored from the target's argmax while it decoded (greedy data)."""
  path = tmp_path / "responses.npz"
  assert drafter_data.write_responses(str(world.data), path) == SEQS
  folder = drafter_training.Trainer(make_config(world, "folder")).data
  tokens_only = drafter_training.Trainer(make_config(
      world, "responses", data__features="online", data__folders=(),
      data__responses=(str(path),))).data
  assert tokens_only.online and not folder.online
  checked = 0
  for i in folder.train_idx:
    pos = np.arange(folder.prompt_lens[i], folder.ends[i] - folder.starts[i] - 1)
    want, want_ok = folder.labels(i, pos, 4)
    got, got_ok = tokens_only.labels(i, pos, 4)
    np.testing.assert_array_equal(got_ok, want_ok)
    np.testing.assert_array_equal(got[want_ok], want[want_ok])
    checked += int(want_ok.sum())
  assert checked > 100


def test_online_resume_after_interruption_equals_one_go(world):
  online = dict(data__features="online", train__target_chunk=16)
  one_go = drafter_training.Trainer(make_config(world, "online_one_go", **online))
  one_go.run()
  drafter_training.Trainer(make_config(world, "online_cut", **online)).run(until=5)
  resumed = drafter_training.Trainer(make_config(world, "online_cut", **online))
  assert resumed.step == 5
  resumed.run()
  got, want = flat(resumed.state["params"]), flat(one_go.state["params"])
  for path in want:
    assert np.array_equal(got[path], want[path]), path
  loss = lambda h: [(r["step"], r["loss"]) for r in h if "loss" in r]  # noqa: E731
  assert loss(resumed.history) == loss(one_go.history)
  assert len(loss(one_go.history)) == tiny.get_config().train.steps


def test_online_data_stage_decodes_like_transformers_and_resumes(world, tmp_path):
  """--stage=data for online training: the batched decoder's greedy responses (batch 5 over 12
  prompts, in two runs: the second does only the prompts the first did not) equal transformers'
  greedy generate; the folder holds tokens only, trains online and is refused for stored
  features with a line that says what to do."""
  target = load_target(world.target_dir, jnp.float32, progress=False)
  rng = np.random.default_rng(1)
  rows = [dict(uid=r, prompt_ids=rng.integers(0, SPEC.vocab_size - 1, int(n)).tolist())
          for r, n in enumerate(rng.integers(4, 9, SEQS))]
  stop = SPEC.vocab_size - 1
  run = lambda rows: responses.run(  # noqa: E731
      target, None, rows, out=tmp_path / "data", target_dir=str(world.target_dir), stops=(stop,),
      batch_size=5, max_new_tokens=NEW, sampling=Sampling(), log=lambda *_: None)
  assert run(rows[:7])["new_tokens"] > 0
  second = run(rows)
  shards = drafter_data.load_shards(str(tmp_path / "data"), features=False)
  assert len(shards.uids) == SEQS and shards.features is None
  assert second["new_tokens"] == sum(shards.ends[shards.uids >= 7] - shards.starts[
      shards.uids >= 7] - shards.prompt_lens[shards.uids >= 7])
  hf = Qwen3ForCausalLM.from_pretrained(world.target_dir, dtype=torch.float32).eval()
  for i, uid in enumerate(shards.uids):
    prompt = rows[int(uid)]["prompt_ids"]
    with torch.no_grad():
      ref = hf.generate(torch.tensor([prompt]), max_new_tokens=NEW, do_sample=False,
                        eos_token_id=stop, pad_token_id=stop)[0, len(prompt):].tolist()
    ids = shards.tokens[shards.starts[i]:shards.ends[i]].tolist()
    assert ids == prompt + ref
    assert shards.greedy[shards.starts[i]:shards.ends[i] - 1].tolist() == ids[1:]
  trainer = drafter_training.Trainer(make_config(world, "online_folder", data__features="online",
                                                 data__folders=(str(tmp_path / "data"),)))
  assert np.isfinite(trainer.take_step()["loss"])
  with pytest.raises(ValueError, match=r"holds tokens only .* --config.data.features=online"):
    drafter_training.Trainer(make_config(world, "stored_folder",
                                         data__folders=(str(tmp_path / "data"),)))


@pytest.mark.skipif(jax.device_count() >= DEVICES, reason="this process already has the devices")
def test_on_fake_cpu_devices(tmp_path):
  out = run_in_child(__file__, "data_parallel", tmp_path, DEVICES)
  assert "2 passed" in out, out[-2000:]


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


@pytest.mark.skipif(jax.device_count() < DEVICES, reason="needs 8 devices: runs in the child")
def test_data_parallel_and_tensor_parallel_step(world):
  """A 4 x 2 (data, model) mesh: drafter, AdamW moments, heads and the frozen target split over
  `model`. Online features equal one device's to the float32 error of another summation order
  (tensor parallelism splits o_proj's and down_proj's sums: at most ~2 K 2^-24 of the summands'
  magnitude, K <= 4 layers x 48 terms, so <= 2^-15 of the largest value) plus one bfloat16
  step of the value (2^-7 |a|: the difference can move it across a rounding boundary). From the
  same (stored) features the losses equal one device's to float32 summation-order rounding
  (1e-5, as the data-parallel test above)."""
  tp = dict(mesh__data=4, mesh__model=2)
  online = dict(data__features="online", train__target_chunk=16)
  single = drafter_training.Trainer(make_config(world, "tp1_online", mesh__data=1, **online))
  split = drafter_training.Trainer(make_config(world, "tp8_online", **tp, **online))
  batch = single.batch(0)
  want = np.asarray(objective.context_features(single.online, single.target, batch), np.float32)
  got = np.asarray(objective.context_features(split.online, split.target, split._put(batch)),
                   np.float32)
  real = np.arange(want.shape[1])[None] < batch["lengths"][:, None]
  np.testing.assert_allclose(got[real], want[real], rtol=2.0 ** -7,
                             atol=2.0 ** -15 * np.abs(want[real]).max())

  single = drafter_training.Trainer(make_config(world, "tp1", mesh__data=1, train__lr=1e-3))
  split = drafter_training.Trainer(make_config(world, "tp8", **tp, train__lr=1e-3))

  def q_proj(state):
    return [v.get_value() for p, v in nnx.to_flat_state(state) if "q_proj" in map(str, p)][0]

  assert q_proj(split.state["params"]).sharding.spec == P(None, "model")
  mu = optax.tree_utils.tree_get(split.state["opt_state"], "mu")
  assert q_proj(mu).sharding.spec == P(None, "model")
  assert split.head.sharding.spec == P("model", None)
  for _ in range(2):
    a, b = single.take_step(), split.take_step()
    np.testing.assert_allclose(b["loss"], a["loss"], rtol=0, atol=1e-5)


@pytest.mark.parametrize("overrides, error, match", [
    (dict(model__block_size=1), ValueError, "block_size=1 < 2"),
    (dict(train__loss_positions=4), ValueError, "loss_positions=4"),
    (dict(model__target_layer_ids=(0, 3)), ValueError, r"target_layer_ids \[1, 3\].*\[0, 3\]"),
    (dict(model__init_from=3), ValueError, "init_from=3"),
    (dict(model__mask_token_id=96), ValueError, "mask_token_id 96"),
    (dict(model__dtype="float64"), ValueError, "model.dtype='float64'"),
    (dict(data__folders=("/nonexistent/drafter_data",)), FileNotFoundError,
     "/nonexistent/drafter_data"),
    (dict(data__features="cached"), ValueError, "data.features='cached'"),
    (dict(data__responses=("r.npz",)), ValueError, "data.responses .* needs data.features=online"),
    (dict(target__numerics="exact"), ValueError, "target.numerics='exact'"),
    (dict(mesh__model=3), ValueError, "mesh.model=3"),
])
def test_bad_input_is_named(world, overrides, error, match):
  with pytest.raises(error, match=match):
    drafter_training.Trainer(make_config(world, "bad", **overrides))
