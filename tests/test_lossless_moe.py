"""Lossless on Qwen3-MoE targets: float32 greedy speculative decoding, every method, emits the
target-only greedy tokens on random MoE pairs (dense layers mixed in), on one device, on a 2 x 4
mesh of fake CPU devices (experts split over `model`) and across 2 processes.

On MOE the verify passes run the experts through ragged_dot (many tokens) while target-only
decoding at batch 3 gathers expert slices (3 * 3 * top_k <= experts), so both lowerings meet in
its comparisons. The
machinery is test_lossless's, test_sharding's and test_multiprocess's."""

import json

import jax
import pytest

from cure_jax.analysis import random_models
from cure_jax.runtime.generation import Generator
from tests.fake_devices import run_in_child
from tests.test_lossless import _cure, check_equals_target_greedy
from tests.test_multiprocess import _decode_args, _launch
from tests.test_sharding import DEVICES, _mesh, on_mesh

# 24 experts, 2 per token, layer 1 dense; 6 experts, 3 per token, raw (unnormalised) weights.
# Both split 4 ways (heads, KV heads, expert intermediate = hidden, vocabulary).
MOE = random_models.Arch(heads=4, kv_heads=4, experts=24, top_k=2, dense_layers=(1,))
MOE_RAW = random_models.Arch(vocab=12, heads=4, kv_heads=4, experts=6, top_k=3,
                             norm_topk_prob=False, dense_layers=(0,))
MAX_NEW = 16
METHODS = ("chain", "cure", "ddtree", "hybrid")


@pytest.mark.parametrize("arch, seeds", [(MOE, range(4)), (MOE_RAW, range(2))],
                         ids=["moe", "moe_raw"])
def test_every_method_equals_target_greedy(arch, seeds):
  counters = check_equals_target_greedy(arch, seeds, full=True)
  assert counters["long_accepts"] > 10, counters
  assert counters["repair_wins"] > 3, counters


@pytest.mark.skipif(jax.device_count() >= DEVICES, reason="this process already has the devices")
def test_on_fake_cpu_devices(tmp_path):
  out = run_in_child(__file__, "on_mesh", tmp_path, DEVICES)
  assert " passed" in out and "skipped" not in out, out[-2000:]


def _generator(method, target, drafter, mesh=None):
  cure = _cure(MOE, v_max=12, topk=2) if method not in ("ar", "chain") else None
  return Generator(target, drafter if method != "ar" else None, method=method,
                   max_new_tokens=MAX_NEW, cure=cure, mesh=mesh)


@on_mesh
def test_on_mesh_every_method_equals_target_greedy():
  target, drafter = random_models.pair(MOE, 5)
  batch = random_models.prompts(5, MOE.vocab, 3)   # padded to 4 for data=2
  want = [r.output_ids for r in _generator("ar", target, drafter).generate(batch)]
  mesh = _mesh(2, 4)
  for method in ("ar",) + METHODS:
    got = _generator(method, target, drafter, mesh).generate(batch)
    assert [r.output_ids for r in got] == want, method
    assert method == "ar" or any(n >= 2 for r in got for n in r.accept_lengths), method


@on_mesh
def test_on_mesh_an_expert_width_that_does_not_divide_is_named():
  odd = random_models.Arch(hidden=34, heads=4, kv_heads=4, experts=4)   # all layers sparse
  target, _ = random_models.pair(odd, 0)
  with pytest.raises(ValueError, match=r"^the target cannot be split over mesh.model=4: "
                                       r"moe_intermediate_size=34 not divisible by 4"):
    Generator(target, method="ar", max_new_tokens=4, mesh=_mesh(2, 4))


@pytest.fixture(scope="module")
def moe_world(tmp_path_factory):
  root = tmp_path_factory.mktemp("mp_moe")
  target, drafter = random_models.pair(MOE, 3)
  target_dir, drafter_dir = random_models.write_hf(root, target, drafter)
  prompts = random_models.prompts(3, MOE.vocab, 4, lo=3, hi=10)
  (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt_ids": p}) + "\n"
                                              for p in prompts))
  ref = Generator(target, method="ar", max_new_tokens=12).generate(prompts)
  return root, target_dir, drafter_dir, [r.output_ids for r in ref]


@pytest.mark.parametrize("method", ["cure", "ddtree"])
def test_across_two_processes_equals_target_greedy(moe_world, method):
  """2 processes x 4 fake devices, mesh data=2 model=4, loaded from HF directories."""
  root, target_dir, drafter_dir, want = moe_world
  out = root / f"{method}.json"
  status, log, _ = _launch(_decode_args(root, target_dir, drafter_dir, method, 2, 4, out))
  assert status == 0, log[-6000:]
  assert [r["output_ids"] for r in json.loads(out.read_text())["results"]] == want
