"""Tensor-parallel / data-parallel decoding on a device mesh (cure_jax.sharding).

The checks need 8 devices. In a process with fewer (a plain `python -m pytest tests`), a single
test re-runs this file in a child process whose XLA_FLAGS ask for 8 fake CPU devices (the flag
must be set before jax starts, so it cannot be set here); the other tests run only in the child,
or directly when jax already sees 8 devices.
"""


import jax
import numpy as np
import pytest
from flax import nnx

from cure_jax.tree import controller, repair
from cure_jax.runtime import sharding
from cure_jax.runtime.generation import PREFILL_CHUNK, Generator
from cure_jax.analysis import random_models
from tests.fake_devices import run_in_child

DEVICES = 8
on_mesh = pytest.mark.skipif(jax.device_count() < DEVICES,
                             reason=f"needs {DEVICES} devices: runs in the child process")

ARCH = random_models.Arch(layers=2, draft_layers=1, target_layer_ids=(0, 1))  # model axis <= 2
WIDE = random_models.Arch(heads=4, kv_heads=4)                                # model axis <= 4
MAX_NEW = 16


@pytest.mark.skipif(jax.device_count() >= DEVICES, reason="this process already has the devices")
def test_on_fake_cpu_devices(tmp_path):
  out = run_in_child(__file__, "not test_on_fake_cpu_devices", tmp_path, DEVICES)
  assert " passed" in out and "skipped" not in out, out[-2000:]


def _mesh(data, model):
  return sharding.make_mesh(data, model, devices=jax.devices()[:data * model])


def _generator(method, target, drafter, mesh=None, **kw):
  cure = repair.RepairConfig(tau_margin=1e9, v_max=12, max_depth=ARCH.block_size - 1)
  auto = controller.Settings(budgets=(1, 3, 8), costs=(1.0, 1.2, 1.5), explore_every=2)
  return Generator(target, drafter if method != "ar" else None, method=method,
                   max_new_tokens=MAX_NEW, cure=cure if method in ("cure", "auto") else None,
                   mesh=mesh, auto=auto if method == "auto" else None, **kw)


@on_mesh
@pytest.mark.parametrize("chunk", [PREFILL_CHUNK, 4], ids=["one_step_prefill", "chunks_of_4"])
@pytest.mark.parametrize("method", ["ar", "chain", "cure", "auto"])
def test_sharded_decoding_equals_unsharded(method, chunk):
  """Against one device prefilling each prompt in one step; prompts of 7, 8 and 9 tokens with
  chunks of 4 (under, at and over a chunk multiple)."""
  target, drafter = random_models.pair(ARCH, 5)
  # 3 prompts: padded to 4 for data=2
  batch = (random_models.prompts(5, ARCH.vocab, 3) if chunk == PREFILL_CHUNK else
           [random_models.prompts(5 + n, ARCH.vocab, 1, lo=n, hi=n)[0] for n in (7, 8, 9)])
  ref = _generator(method, target, drafter).generate(batch)
  if method == "auto":  # the controller switched budgets (plain steps and drafts)
    assert len({st["budget"] for r in ref for st in r.stats}) >= 2
  else:
    assert method == "ar" or any(n >= 2 for r in ref for n in r.accept_lengths)  # accepted
  branch = lambda r: [s["winning_branch"] for s in r.stats]
  assert method != "cure" or any(any(branch(r)) for r in ref)                  # repairs won
  for data, model in ((1, 2), (2, 2)):
    gen = _generator(method, target, drafter, _mesh(data, model), prefill_chunk=chunk)
    got = gen.generate(batch)
    assert len(got) == len(batch)
    for g, r in zip(got, ref):
      assert g.output_ids == r.output_ids, (method, data, model)
      if method == "auto":  # the padded batch row weighs in the controller's batch-wide choice
        continue
      assert g.accept_lengths == r.accept_lengths, (method, data, model)
      assert branch(g) == branch(r), (method, data, model)
    # The compiled state keeps the KV caches split: batch over data, KV heads over model.
    padded = len(batch) + (-len(batch) % data)
    pre, dec = gen._executables(padded, 32, gen.cache_len(max(map(len, batch))))  # cached ones
    for exe in (pre, dec):
      assert all(k.spec == sharding.CACHE_SPEC for k in exe.output_shardings.cache.k)
      assert exe.output_shardings.tokens.spec == jax.sharding.PartitionSpec("data", None)


def _device0_fraction(x: jax.Array) -> float:
  dev = jax.devices()[0]
  return sum(s.data.nbytes for s in x.addressable_shards if s.device == dev) / x.nbytes


@on_mesh
@pytest.mark.parametrize("numerics", ["default", "invariant"])
def test_parameters_take_one_mth_per_device(numerics):
  """Each big matrix is split four ways; held as rows (numerics=invariant), on the same axis of
  the model (the rule reversed), so a q_proj's shard is its heads' rows."""
  target, drafter = random_models.pair(WIDE, 0)
  target.numerics = numerics
  mesh = sharding.make_mesh(2, 4)
  _, state = nnx.split((target, drafter))
  sharded = sharding.shard_state(state, mesh)
  big = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
         "embed_tokens", "lm_head")
  seen = set()
  for (path, ref), (_, var) in zip(nnx.to_flat_state(state), nnx.to_flat_state(sharded)):
    x = var.get_value()
    np.testing.assert_array_equal(np.asarray(x), np.asarray(ref.get_value()))
    kind = next((name for name in big if name in path), None)
    assert _device0_fraction(x) == (0.25 if kind else 1.0), path
    seen.add(kind)
  assert seen == set(big) | {None}
  q = next(v.get_value() for path, v in nnx.to_flat_state(sharded)
           if path[0] == 0 and "q_proj" in path)   # the target's
  heads_axis = 0 if numerics == "invariant" else 1
  assert q.addressable_shards[0].data.shape[heads_axis] == q.shape[heads_axis] // 4
  total = sum(v.get_value().nbytes for _, v in nnx.to_flat_state(sharded))
  on_dev0 = sum(_device0_fraction(v.get_value()) * v.get_value().nbytes
                for _, v in nnx.to_flat_state(sharded))
  assert on_dev0 < 0.3 * total   # norms and the replicated DFlash fc are the rest


@on_mesh
def test_pipeline_loads_straight_onto_the_mesh(tmp_path):
  from configs import common
  from cure_jax.checkpoints.qwen3 import convert_hf, load_target
  from cure_jax.runtime import pipeline
  target, drafter = random_models.pair(ARCH, 5)   # test_sharded_decoding's ar compile is reused
  target_dir, drafter_dir = random_models.write_hf(tmp_path, target, drafter)
  config = common.base_config()
  config.method = "ar"
  config.max_new_tokens = MAX_NEW
  config.target.path, config.drafter.path = str(target_dir), str(drafter_dir)
  config.mesh.data, config.mesh.model = 4, 2
  mesh = pipeline.mesh_of(config)
  loaded = pipeline.load_target(config)
  config.method = "chain"
  loaded_drafter = pipeline.load_drafter(config, loaded)
  ckpt = convert_hf(target_dir, tmp_path / "orbax", "float32", progress=False)
  restored = load_target(ckpt, "float32", progress=False, placement=sharding.placement(mesh))
  for source, module in ((target, loaded), (drafter, loaded_drafter), (target, restored)):
    for (path, ref), (_, var) in zip(nnx.to_flat_state(nnx.state(source)),
                                     nnx.to_flat_state(nnx.state(module))):
      x = var.get_value()
      assert x.sharding == sharding.placement(mesh).sharding(path, x.shape), path
      np.testing.assert_array_equal(np.asarray(x), np.asarray(ref.get_value()))
  config.method = "ar"
  gen = pipeline.make_generator(config, loaded, None)
  assert gen.mesh == mesh
  batch = random_models.prompts(1, ARCH.vocab, 3)
  ref = Generator(target, method="ar", max_new_tokens=MAX_NEW).generate(batch)
  assert [r.output_ids for r in gen.generate(batch)] == [r.output_ids for r in ref]


@on_mesh
def test_settings_that_cannot_be_split_are_named(tmp_path):
  with pytest.raises(ValueError, match=r"3 \* 2 = 6, but 8 cpu device"):
    sharding.make_mesh(3, 2)
  target, drafter = random_models.pair(ARCH, 0)   # 4 heads, 2 KV heads, vocab 8
  with pytest.raises(ValueError, match=r"num_key_value_heads=2 not divisible by 4.*"
                                       r"--config.mesh.model=2"):
    Generator(target, method="ar", max_new_tokens=4, mesh=_mesh(1, 4))
  odd_vocab, _ = random_models.pair(random_models.Arch(vocab=6, heads=4, kv_heads=4), 0)
  with pytest.raises(ValueError, match=r"target cannot be split over mesh.model=4: vocab_size=6"):
    Generator(odd_vocab, method="ar", max_new_tokens=4, mesh=_mesh(2, 4))
  with pytest.raises(ValueError, match=r"drafter cannot be split over mesh.model=4: "
                                       r"num_key_value_heads=2"):
    sharding.check_models(_mesh(2, 4), random_models.pair(WIDE, 0)[0], drafter)
  # Per tensor, e.g. while streaming a checkpoint: the tensor and the config field are named.
  with pytest.raises(ValueError, match=r"layers/0/mlp/up_proj/kernel \(32, 6\).*intermediate_size"):
    sharding.placement(_mesh(2, 4))(("layers", 0, "mlp", "up_proj", "kernel"),
                                    np.zeros((32, 6), np.float32))
  with pytest.raises(ValueError, match="no partition rule for parameter rotary/inv_freq"):
    sharding.spec_for(("rotary", "inv_freq"), (4,), _mesh(2, 4))
  # Through the pipeline, from config.json, before any weight is read.
  from configs import common
  from cure_jax.runtime import pipeline
  target_dir, _ = random_models.write_hf(tmp_path, target, drafter)
  config = common.base_config()
  config.target.path = str(target_dir)
  config.mesh.data, config.mesh.model = 2, 4
  with pytest.raises(ValueError, match=f"model at {target_dir} cannot be split.*"
                                       "num_key_value_heads=2"):
    pipeline.load_target(config)
