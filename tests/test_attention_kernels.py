"""The attention kernels, TPU (Pallas/Mosaic) and GPU (Pallas/Triton), run here in Pallas
interpret mode, against attention written out in float64 numpy, over the shapes decoding gives
them: one query, a verification block, several blocks sharing a context (CURE's re-draft), an
empty or part-visible cache, several key blocks, several cache ranges (the GPU kernel's split-K)
and row blocks. On fake CPU devices each sharded kernel (per data x model shard) equals the whole
one, and decoding through either emits the target's greedy tokens."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cure_jax.runtime import generation, sharding
from cure_jax.analysis import random_models
from cure_jax.tree import repair
from cure_jax.runtime.generation import Generator
from cure_jax.models import dflash, layers, qwen3
from cure_jax.models.kernels import cpu_attention, gpu_attention, tpu_attention
from tests.fake_devices import run_in_child

# (batch, blocks A, rows T, heads, KV heads, head dim, cache slots S, new tokens U)
SHAPES = [(2, 1, 1, 4, 2, 128, 256, 1),       # target-only decoding
          (2, 1, 17, 8, 2, 64, 1024, 17),     # verification; two 512-slot key blocks
          (1, 5, 16, 8, 4, 64, 384, 16),      # re-draft: five blocks over one context
          (3, 2, 3, 2, 1, 32, 128, 5),
          (1, 1, 32, 8, 2, 128, 2048, 32)]     # a CURE tree: 4 cache ranges on the GPU kernel

# name -> (attend, whether it takes a cache of S slots with G query heads per KV head, head dim D)
KERNELS = {"tpu": (tpu_attention.attend, lambda s, g, d: tpu_attention.tiles(s)),
           "gpu": (gpu_attention.attend, gpu_attention.tiles)}


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
  mask_old = visible[:, None, None]                     # [B, 1, 1, S]: every row's, as a tree's
  if not shared_mask:                                   # rows that see only part of it
    mask_old = mask_old & (rng.random((b, a, t, s)) < 0.9)
  mask_new = (rng.random((b, a, t, u)) < 0.5) | np.eye(t, u, dtype=bool)  # each row sees one
  return (f(b, a, t, h, d), f(b, kvh, s, d), f(b, kvh, s, d), f(b, a, u, kvh, d),
          f(b, a, u, kvh, d), mask_old, mask_new)


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("shared_mask", [False, True])
def test_kernel_equals_softmax_attention(kernel, shape, shared_mask):
  args = _inputs(shape, seed=sum(shape), shared_mask=shared_mask)
  want = reference(*(np.asarray(x, np.float64) if x.dtype != bool else
                     np.broadcast_to(x, args[0].shape[:3] + x.shape[-1:]) for x in args))
  got = KERNELS[kernel][0](*map(jnp.asarray, args), interpret=True)
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("slots, tiles", [(0, False), (100, False), (128, True), (4096, True)])
def test_caches_the_tpu_kernel_takes(slots, tiles):
  assert tpu_attention.tiles(slots) is tiles


@pytest.mark.parametrize("slots, groups, head_dim, tiles", [
    (0, 4, 128, False), (100, 4, 128, False), (64, 4, 128, True), (4096, 4, 128, True),
    (4096, 3, 64, False), (4096, 4, 96, False), (4096, 4, 8, False)])  # SmolLM2's G = 3: XLA
def test_caches_the_gpu_kernel_takes(slots, groups, head_dim, tiles):
  assert gpu_attention.tiles(slots, groups, head_dim) is tiles


@pytest.mark.parametrize("b, kvh, row_blocks, slots, splits", [
    (1, 8, 1, 4096, 8),          # Qwen3-8B at batch 1: 64 programs, 512-slot ranges
    (8, 8, 1, 4096, 2),          # batch 8: 128 programs
    (1, 8, 2, 256, 1),           # a short cache is one range
    (64, 8, 1, 4096, 1)])
def test_gpu_cache_ranges_fill_the_grid_but_stay_long(b, kvh, row_blocks, slots, splits):
  assert gpu_attention.num_splits(b, kvh, row_blocks, slots) == splits


# kernel -> (cache slots, per row the first slot past the block that holds its last visible one)
POISON_FROM = {"gpu": (1024, (192, 704)),    # 64-slot blocks, per row
               "tpu": (2048, (512, 1024)),   # 512-slot blocks, per row
               "cpu": (1024, (768, 768))}    # 128-slot blocks up to the last any row sees


@pytest.mark.parametrize("kernel", POISON_FROM)
def test_no_block_past_the_last_visible_slot_is_read(kernel, monkeypatch):
  """Cache slots past the block holding a row's last visible slot (for the CPU loop: any row's)
  are not read: poison them (NaN) and the result holds, bitwise. So a step's work follows the
  context held, not the cache's size."""
  monkeypatch.setattr(cpu_attention, "BLOCK", 128)
  attend = {"gpu": lambda *a: gpu_attention.attend(*a, interpret=True),
            "tpu": lambda *a: tpu_attention.attend(*a, interpret=True),
            "cpu": jax.jit(cpu_attention.blocked)}[kernel]
  slots, poison = POISON_FROM[kernel]
  args = list(_inputs((2, 1, 4, 4, 2, 64, slots, 4), seed=3))
  args[5] = np.broadcast_to(np.arange(slots) < np.array([130, 700])[:, None, None, None],
                            args[5].shape)
  want = attend(*map(jnp.asarray, args))
  for i, n in enumerate(poison):
    args[1][i, :, n:] = np.nan
    args[2][i, :, n:] = np.nan
  got = attend(*map(jnp.asarray, args))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  assert np.isfinite(np.asarray(got)).all()


@pytest.mark.parametrize("form", ["blocked", "attend"])
@pytest.mark.parametrize("shape", SHAPES + [(2, 1, 4, 4, 2, 16, 1300, 4)])
def test_cpu_attention_equals_softmax_attention(shape, form, monkeypatch):
  """The CPU forms: the blocked loop (here 128-slot blocks, so several; 1300 slots end in a
  block that overlaps the one before it) and attend, which picks it or one pass over the whole
  cache, both an online softmax."""
  monkeypatch.setattr(cpu_attention, "BLOCK", 128)
  args = _inputs(shape, seed=sum(shape), shared_mask=shape[1] > 1)
  want = reference(*(np.asarray(x, np.float64) if x.dtype != bool else
                     np.broadcast_to(x, args[0].shape[:3] + x.shape[-1:]) for x in args))
  got = jax.jit(getattr(cpu_attention, form))(*map(jnp.asarray, args))
  np.testing.assert_allclose(np.asarray(got), want, rtol=2e-5, atol=2e-5)


@pytest.mark.parametrize("longest,whole", [(300, False), (400, True)])
def test_cpu_attention_reads_the_blocks_in_use_while_the_context_is_short(longest, whole,
                                                                          monkeypatch):
  """attend on CPU takes the blocked loop while the longest row sees at most a third of the
  cache and one pass over the whole cache above it. Slots 512 on (past every row's last visible
  one) are poisoned with NaN: the loop leaves them unread (the result holds, bitwise); the whole
  pass reads them (0 x NaN in the value product shows)."""
  monkeypatch.setattr(cpu_attention, "BLOCK", 128)
  args = list(_inputs((2, 1, 4, 4, 2, 64, 1024, 4), seed=4))
  args[5] = np.broadcast_to(np.arange(1024) < np.array([130, longest])[:, None, None, None],
                            args[5].shape)
  attend = jax.jit(cpu_attention.attend)
  want = np.asarray(attend(*map(jnp.asarray, args)))
  args[1][:, :, 512:] = np.nan
  args[2][:, :, 512:] = np.nan
  got = np.asarray(attend(*map(jnp.asarray, args)))
  if whole:
    assert np.isnan(got[1]).all()
  else:
    np.testing.assert_array_equal(got, want)


def test_cpu_blocked_attention_of_a_row_does_not_depend_on_the_others(monkeypatch):
  """A row's output is bitwise the same alone and beside a row that sees 7 more blocks: the
  extra blocks add exact zeros to its sums and leave its running maximum as it was."""
  monkeypatch.setattr(cpu_attention, "BLOCK", 128)
  args = list(_inputs((2, 1, 1, 4, 2, 16, 1024, 1), seed=6))
  args[5] = np.broadcast_to(np.arange(1024) < np.array([100, 1000])[:, None, None, None],
                            args[5].shape)
  attend = jax.jit(cpu_attention.blocked)
  both = attend(*map(jnp.asarray, args))
  alone = attend(*(jnp.asarray(np.stack([x[0], x[0]])) for x in args))
  np.testing.assert_array_equal(np.asarray(both)[0], np.asarray(alone)[0])


def test_on_fake_cpu_devices(tmp_path):
  run_in_child(__file__, "sharded_kernel", tmp_path, devices=8)


@pytest.mark.parametrize("kernel", KERNELS)
def test_sharded_kernel_equals_whole(kernel):
  if jax.device_count() < 8:
    pytest.skip("runs in test_on_fake_cpu_devices' child, with 8 fake devices")
  attend = KERNELS[kernel][0]
  args = [jnp.asarray(x) for x in _inputs((4, 1, 3, 8, 4, 32, 256, 3), seed=5)]
  want = attend(*args, interpret=True)
  mesh = sharding.make_mesh(2, 4)
  with jax.set_mesh(mesh):
    got = jax.jit(lambda *xs: attend(*xs, interpret=True))(*args)
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kernel", KERNELS)
def test_decoding_through_the_kernel_equals_target_greedy(kernel, monkeypatch):
  """Every target and drafter layer through the (interpreted) kernel, as on TPU or GPU: CURE and
  chain still emit the target's greedy tokens, and those equal the XLA path's."""
  attend, tiles = KERNELS[kernel]
  arch = random_models.Arch(head_dim=16)     # a head the GPU kernel takes (Triton: >= 16)
  target, drafter = random_models.pair(arch, seed=7)
  batch = random_models.prompts(7, arch.vocab, 3)
  new = dict(max_new_tokens=16, max_len=128)       # 128 slots: a cache the kernel tiles
  want = Generator(target, method="ar", **new).generate(batch)

  traced = []

  def through_kernel(*args, kernel=True, exponents=None):   # layers.attend's signature
    q, k_old = args[:2]
    if kernel and tiles(k_old.shape[2], q.shape[3] // k_old.shape[1], q.shape[4]):
      traced.append(q.shape)
      return attend(*args, interpret=True)
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


def _chunk_reference(q, k_cache, v_cache, k_new, v_new, lengths):
  """A prompt chunk's attention in float64: query i of row b sees the row's first lengths[b]
  cache slots and the chunk's tokens 0..i."""
  b, t, h, d = q.shape
  g = h // k_cache.shape[1]
  out = np.zeros(q.shape)
  for i, r, n in np.ndindex(b, t, h):
    keys = np.concatenate([k_cache[i, n // g, :lengths[i]], k_new[i, :r + 1, n // g]])
    vals = np.concatenate([v_cache[i, n // g, :lengths[i]], v_new[i, :r + 1, n // g]])
    s = keys @ q[i, r, n] / np.sqrt(d)
    p = np.exp(s - s.max())
    out[i, r, n] = p @ vals / p.sum()
  return out


@pytest.mark.parametrize("lengths", [(0, 128), (64, 256), (192, 5)])
def test_prompt_chunk_kernels_and_xla_form_equal_softmax_attention(lengths):
  """prefix.attend's forms: the GPU and TPU kernels (interpreted), XLA's blocks over the cache; a
  chunk of 128 tokens (two row blocks, the diagonal key blocks) after caches of 256 slots filled
  to `lengths` (empty, a key block, whole, part of one). Rows past `count` are padding."""
  from cure_jax.models.kernels import gpu_prefix, prefix
  rng = np.random.default_rng(sum(lengths))
  f = lambda *dims: rng.normal(size=dims).astype(np.float32)            # noqa: E731
  b, t, h, kvh, d, s = 2, 128, 4, 2, 16, 256
  args = (f(b, t, h, d), f(b, kvh, s, d), f(b, kvh, s, d), f(b, t, kvh, d), f(b, t, kvh, d))
  lengths = np.asarray(lengths, np.int32)
  count = np.asarray([t, 100], np.int32)
  want = _chunk_reference(*args, lengths)
  assert gpu_prefix.tiles(s, t, d)
  kernel = gpu_prefix.attend(*map(jnp.asarray, args), jnp.asarray(lengths), interpret=True)
  more = (jnp.asarray(lengths), jnp.asarray(count))
  tpu = prefix.tpu_attend(*map(jnp.asarray, args), *more, interpret=True)
  xla, k_out, v_out = prefix.xla_attend(*map(jnp.asarray, args), *more)
  for got in (kernel, tpu, xla):
    for row, n in enumerate(count):
      np.testing.assert_allclose(np.asarray(got)[row, :n], want[row, :n], rtol=2e-5, atol=2e-5)
  np.testing.assert_array_equal(k_out, args[1])    # the loop hands the caches back unchanged
  np.testing.assert_array_equal(v_out, args[2])


def test_prompt_chunk_attend_writes_the_chunk_after_each_prefix():
  """prefix.attend returns the caches with each row's first `count` chunk tokens at slots
  lengths..lengths+count-1 and every other slot as it was (a numpy scatter as reference)."""
  from cure_jax.models.kernels import prefix
  rng = np.random.default_rng(3)
  f = lambda *dims: rng.normal(size=dims).astype(np.float32)            # noqa: E731
  b, t, h, kvh, d, s = 3, 8, 4, 2, 16, 24
  q, k_cache, v_cache, k_new, v_new = f(b, t, h, d), f(b, kvh, s, d), f(b, kvh, s, d), \
      f(b, t, kvh, d), f(b, t, kvh, d)
  lengths, count = np.asarray([0, 5, 20], np.int32), np.asarray([8, 3, 8], np.int32)
  _, k_out, v_out = prefix.attend(*map(jnp.asarray, (q, k_cache, v_cache, k_new, v_new)),
                                  prefix.Prefix(lengths=jnp.asarray(lengths),
                                                count=jnp.asarray(count)))
  for cache, new, got in ((k_cache, k_new, k_out), (v_cache, v_new, v_out)):
    want = cache.copy()
    for row in range(b):
      n = min(count[row], s - lengths[row])                  # writes past the cache are dropped
      want[row, :, lengths[row]:lengths[row] + n] = new[row, :n].swapaxes(0, 1)
    np.testing.assert_array_equal(np.asarray(got), want)
