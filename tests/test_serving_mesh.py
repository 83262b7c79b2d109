"""The serving engine on a mesh of one host (tensor parallel over `model`, slots' rows split
over `data`) against offline decoding on one device: a request's tokens equal
`Generator.generate` decoding it alone at batch 1 without a mesh (its own prefill and decode
loop, no slots, nothing sharded). numerics=invariant makes a row's logits independent of the
batch and of how the model axis splits the reductions, so equality is bitwise.

The checks need 8 devices: in a process with fewer, one test re-runs this file in a child
whose XLA sees 8 fake CPU devices (tests/fake_devices.py); the others run only there.
"""

import dataclasses

import jax
import pytest
from jax.sharding import PartitionSpec as P

from cure_jax.analysis import random_models
from cure_jax.runtime import sharding
from cure_jax.serving.engine import Engine, Request
from cure_jax.tree.sampling import Sampling
from tests.fake_devices import run_in_child
from tests.test_serving_engine import (ARCH, MAX_LEN, MAX_NEW, _alone, _generator,
                                       _release_each_tests_programs, _requests, _serve)

DEVICES = 8
on_mesh = pytest.mark.skipif(jax.device_count() < DEVICES,
                             reason=f"needs {DEVICES} devices: runs in the child process")
pytestmark = pytest.mark.usefixtures(_release_each_tests_programs.__name__)

WIDE = dataclasses.replace(ARCH, kv_heads=4)   # every split dimension divides by model=4


@pytest.mark.skipif(jax.device_count() >= DEVICES, reason="this process already has the devices")
def test_on_fake_cpu_devices(tmp_path):
  out = run_in_child(__file__, "not test_on_fake_cpu_devices", tmp_path, DEVICES)
  assert " passed" in out and "skipped" not in out, out[-2000:]


@pytest.fixture(scope="module")
def models():
  target, drafter = random_models.pair(WIDE, 4)
  target.numerics = "invariant"
  return target, drafter, None


def _mesh(data, model):
  return sharding.make_mesh(data, model, devices=jax.devices()[:data * model])


@on_mesh
@pytest.mark.parametrize("data,model", [(2, 2), (1, 4)])
@pytest.mark.parametrize("method", ["ar", "chain", "cure", "ddtree"])
def test_served_on_a_mesh_equals_each_request_decoded_alone(models, method, data, model):
  """Six greedy requests through 4 slots, arriving at chunks 0, 0, 0, 1, 2, 4 (inserted beside
  running ones, slots reused); the state's rows grow and shrink by multiples of mesh.data and
  keep their shardings (caches: rows over data, KV heads over model)."""
  requests = _requests(6, seed=17)
  engine = Engine(_generator(models, method, MAX_NEW, mesh=_mesh(data, model)), slots=4,
                  max_len=MAX_LEN, steps=2)
  assert engine.buckets == ([2, 4] if data == 2 else [1, 2, 4])
  schedule = []
  got, slots = _serve(engine, requests, [0, 0, 0, 1, 2, 4], schedule)
  assert got == _alone(models, method, requests)
  assert len(set(slots.values())) == 4 and engine.free_slots() == [0, 1, 2, 3]
  assert set(engine.buckets) >= {rows for _, rows in schedule} >= {engine.buckets[0], 4}
  assert all(k.sharding.spec == sharding.CACHE_SPEC for k in engine.state.cache.k)
  assert engine.state.tokens.sharding.spec == P(sharding.DATA, None)


@on_mesh
def test_sampled_requests_on_a_mesh_equal_each_request_decoded_alone(models):
  """A sampled engine on data=2 x model=2: each request samples from its own seed with its own
  temperature, top-k and top-p (a greedy one among them), as decoded alone on one device."""
  settings = [(1.0, 0, 1.0), (0.7, 3, 1.0), (0.0, 0, 1.0), (1.3, 0, 0.8), (1.0, 4, 0.7)]
  requests = [Request(r.prompt, r.max_tokens, r.seed, Sampling(*s))
              for r, s in zip(_requests(5, seed=23), settings)]
  engine = Engine(_generator(models, "cure", MAX_NEW, 1.0, mesh=_mesh(2, 2)), slots=2,
                  max_len=MAX_LEN, steps=3)
  got, _ = _serve(engine, requests, [0, 0, 1, 2, 2])
  alone = [_generator(models, "cure", r.max_tokens, *dataclasses.astuple(r.sampling))
           .generate([list(r.prompt)], seed=r.seed)[0].output_ids for r in requests]
  assert got == alone
  assert sum(g != a for g, a in zip(_alone(models, "cure", requests), alone)) >= 2   # sampled


@on_mesh
def test_slots_not_a_multiple_of_mesh_data_are_refused(models):
  with pytest.raises(ValueError, match=r"slots=3 is not a multiple of mesh.data=2 .* slots=4"):
    Engine(_generator(models, "ar", MAX_NEW, mesh=_mesh(2, 2)), slots=3, max_len=MAX_LEN)
