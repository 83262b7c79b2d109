"""The TPU attention kernel (Pallas, run here in interpret mode) against attention written out
in float64 numpy, over the shapes decoding gives it: one query, a verification block, several
blocks sharing a context (CURE's re-draft), an empty or part-visible cache, several key blocks.
On fake CPU devices the sharded kernel (per data x model shard) equals the whole one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cure_jax.runtime import generation, sharding
from cure_jax.analysis import random_models
from cure_jax.tree import repair
from cure_jax.runtime.generation import Generator
from cure_jax.models import dflash, layers, qwen3
from cure_jax.models.kernels import tpu_attention
from tests.fake_devices import run_in_child

# (batch, blocks A, rows T, heads, KV heads, head dim, cache slots S, new tokens U)
SHAPES = [(2, 1, 1, 4, 2, 128, 256, 1),       # target-only decoding
          (2, 1, 17, 8, 2, 64, 1024, 17),     # verification; two 512-slot key blocks
          (1, 5, 16, 8, 4, 64, 384, 16),      # re-draft: five blocks over one context
          (3, 2, 3, 2, 1, 32, 128, 5)]


def reference(q, k_old, v_old, k_new, v_new, mask_old, mask_new):
  """Softmax attention over [cache ; new tokens], float64, one query row at a time."""
  b, a, t, h, d = q.shape
  kvh = k_old.shape[1]
  out = np.zeros(q.shape)
  for i, j, r, n in np.ndindex(b, a, t, h):
    g = n // (h // kvh)
    keys = np.concatenate([k_old[i, g], k_new[i, j, :, g]])                 # [S + U, D]
    vals = np.concatenate([v_old[i, g], v_new[i, j, :, g]])
    seen = np.concatenate([mask_old[i, j, r], mask_new[i, j, r]])
    s = keys[seen] @ q[i, j, r, n] / np.sqrt(d)
    p = np.exp(s - s.max())
    out[i, j, r, n] = p @ vals[seen] / p.sum()
  return out


def _inputs(shape, seed, shared_mask=False):
  b, a, t, h, kvh, d, s, u = shape
  rng = np.random.default_rng(seed)
  f = lambda *dims: rng.normal(size=dims).astype(np.float32)            # noqa: E731
  lengths = rng.integers(0, s + 1, b)
  lengths[0] = 0                                                          # an empty context
  visible = np.arange(s)[None] < lengths[:, None]                         # [B, S]
  mask_old = np.broadcast_to(visible[:, None, None], (b, 1 if shared_mask else a, t, s))
  mask_new = (rng.random((b, a, t, u)) < 0.5) | np.eye(t, u, dtype=bool)  # each row sees one
  return (f(b, a, t, h, d), f(b, kvh, s, d), f(b, kvh, s, d), f(b, a, u, kvh, d),
          f(b, a, u, kvh, d), mask_old, mask_new)


@pytest.mark.parametrize("shape", SHAPES)
def test_kernel_equals_softmax_attention(shape):
  args = _inputs(shape, seed=sum(shape), shared_mask=shape[1] > 1)
  want = reference(*(np.asarray(x, np.float64) if x.dtype != bool else
                     np.broadcast_to(x, args[0].shape[:3] + x.shape[-1:]) for x in args))
  got = tpu_attention.attend(*map(jnp.asarray, args), interpret=True)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("slots, tiles", [(0, False), (100, False), (128, True), (4096, True)])
def test_caches_the_kernel_takes(slots, tiles):
  assert tpu_attention.tiles(slots) is tiles


def test_on_fake_cpu_devices(tmp_path):
  run_in_child(__file__, "sharded_kernel", tmp_path, devices=8)


def test_sharded_kernel_equals_whole():
  if jax.device_count() < 8:
    pytest.skip("runs in test_on_fake_cpu_devices' child, with 8 fake devices")
  args = [jnp.asarray(x) for x in _inputs((4, 1, 3, 8, 4, 32, 256, 3), seed=5)]
  want = tpu_attention.attend(*args, interpret=True)
  mesh = sharding.make_mesh(2, 4)
  with jax.set_mesh(mesh):
    got = jax.jit(lambda *xs: tpu_attention.attend(*xs, interpret=True))(*args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


def test_decoding_through_the_kernel_equals_target_greedy(monkeypatch):
  """Every target and drafter layer through the (interpreted) kernel, as on TPU: CURE and chain
  still emit the target's greedy tokens, and those equal the XLA path's."""
  arch = random_models.Arch()
  target, drafter = random_models.pair(arch, seed=7)
  batch = random_models.prompts(7, arch.vocab, 3)
  new = dict(max_new_tokens=16, max_len=128)       # 128 slots: a cache the kernel tiles
  want = Generator(target, method="ar", **new).generate(batch)

  traced = []

  def through_kernel(*args, kernel=True):
    if kernel and tpu_attention.tiles(args[1].shape[2]):
      traced.append(args[0].shape)
      return tpu_attention.attend(*args, interpret=True)
    return layers.xla_attend(*args)

  generation.release_compiled()
  jax.clear_caches()                      # or ar would reuse its trace through the XLA path
  monkeypatch.setattr(qwen3, "attend", through_kernel)
  monkeypatch.setattr(dflash, "attend", through_kernel)
  cure = repair.RepairConfig(tau_margin=1e9, v_max=24, beam_width=4, b_max=4,
                             max_depth=arch.block_size - 1)
  for gen in (Generator(target, method="ar", **new),
              Generator(target, drafter, method="chain", **new),
              Generator(target, drafter, method="cure", cure=cure, **new)):
    for got, ref in zip(gen.generate(batch), want):
      assert got.output_ids == ref.output_ids, gen.method
  generation.release_compiled()
  jax.clear_caches()
  assert {q[2] for q in traced} >= {1, arch.block_size}     # decoding steps and verification
