"""Device memory a decode needs, estimated from shapes before anything compiles, so that a tree,
batch or cache that cannot fit is refused in one line with the largest setting that does.

The estimate counts only buffers the compiled program must hold at once, at its peak (one
iteration's verification pass over the whole tree), from the shapes alone:

  caches       target KV cache   2 * L * B * KVH * S * D * itemsize   (the loop carries it)
               drafter state     the same with the drafter's L, KVH, D  (DFlash context K/V,
                                 an autoregressive drafter's KV cache)
  tree masks   [B, V, V] ancestors + [B, V, S + V] attention mask          (bool, 1 byte)
  tree K/V     2 * L * B * V * KVH * D * itemsize: every layer's keys and values of the V tree
               nodes, held until the winning path (known after the last layer) is gathered
  then the larger of
    scores     c * 4 * B * H * V * (S + V): a layer's float32 attention scores over
               [cache ; tree] where attention is XLA tensors (c = 2 on CPU, the
               scores and their exponentials; 1 on GPU/TPU when the cache does not tile for the
               Pallas/Triton kernels; 0 where the kernels keep them on chip)
    logits     4 * B * V * vocab: the target's float32 logits at every node

S = the cache length (max_len), V = the tree's nodes (cure.v_max for cure, ddtree, hybrid and
auto's largest budget; the block for chain and ar_draft; 1 for ar), B = the batch, L/H/KVH/D the
model's layers, heads, KV heads and head size. Weights are not counted: they are already on the
device (its free memory is what is compared) or, on CPU, already out of MemAvailable. Everything
else (activations, the drafter's pass, sampling's distributions) comes on top, so the estimate
is a lower bound: what it refuses cannot run, and a run it allows may still not fit.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Callable

import jax

GB = 1e9


@dataclasses.dataclass(frozen=True)
class Run:
  """The shapes a decode's memory depends on."""

  batch: int
  max_len: int            # S, the static cache length
  nodes: int              # V, tree nodes verified in one pass
  layers: int
  heads: int
  kv_heads: int
  head_dim: int
  vocab: int
  itemsize: int           # bytes of the cache dtype
  drafter: tuple[int, int, int, int] = (0, 0, 0, 0)  # its (layers, KV heads, head_dim, itemsize)
  score_copies: int = 2   # c above: 2 on CPU, 1 XLA attention on GPU/TPU, 0 with a kernel

  def terms(self) -> dict[str, int]:
    """Bytes of each counted buffer (see the module docstring), by a name with its shape."""
    b, s, v = self.batch, self.max_len, self.nodes
    kv = 2 * self.layers * self.kv_heads * self.head_dim * self.itemsize
    dl, dkvh, dd, di = self.drafter
    return {
        f"target KV cache 2 x [{self.layers}, {b}, {self.kv_heads}, {s}, {self.head_dim}]":
            kv * b * s,
        f"drafter K/V 2 x [{dl}, {b}, {dkvh}, {s}, {dd}]": 2 * dl * dkvh * dd * di * b * s,
        f"tree masks [{b}, {v}, {v}] + [{b}, {v}, {s + v}] bool": b * v * v + b * v * (s + v),
        f"tree K/V 2 x [{self.layers}, {b}, {v}, {self.kv_heads}, {self.head_dim}]": kv * b * v,
        (f"attention scores {self.score_copies} x [{b}, {self.heads}, {v}, {s + v}] float32"):
            self.score_copies * 4 * b * self.heads * v * (s + v),
        f"verify logits [{b}, {v}, {self.vocab}] float32": 4 * b * v * self.vocab,
    }

  def total(self) -> int:
    """Bytes held at the peak: the caches, masks and tree K/V, and the larger of a layer's
    attention scores and the logits (the scores are gone when the logits are made)."""
    t = list(self.terms().values())
    return sum(t[:4]) + max(t[4], t[5])

  def caches(self) -> int:
    """Bytes of the target's and the drafter's caches (the part that grows with max_len)."""
    return sum(list(self.terms().values())[:2])

  def largest(self, n: int = 2) -> list[tuple[str, int]]:
    """The n largest counted buffers, largest first."""
    return sorted(((k, b) for k, b in self.terms().items() if b), key=lambda kb: -kb[1])[:n]


def run_of(target, drafter, *, batch: int, max_len: int, nodes: int, platform: str) -> Run:
  """The Run of a Generator's models at this batch, cache length and tree size on `platform`."""
  from cure_jax.models.kernels import gpu_attention, tpu_attention
  cfg = target.cfg
  itemsize = jax.numpy.dtype(target.dtype).itemsize
  drafter_dims = (0, 0, 0, 0)
  if drafter is not None:
    d = drafter.cfg
    drafter_dims = (d.num_layers, d.num_kv_heads, d.head_dim,
                    jax.numpy.dtype(drafter.dtype).itemsize)
  groups = cfg.num_heads // cfg.num_kv_heads
  if platform == "cpu":
    copies = 2
  elif platform == "tpu":
    copies = 0 if tpu_attention.tiles(max_len) else 1
  elif platform in ("gpu", "cuda"):
    copies = 0 if gpu_attention.tiles(max_len, groups, cfg.head_dim) else 1
  else:
    copies = 1
  return Run(batch=batch, max_len=max_len, nodes=nodes, layers=cfg.num_layers,
             heads=cfg.num_heads, kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
             vocab=cfg.vocab_size, itemsize=itemsize, drafter=drafter_dims,
             score_copies=copies)


def available(devices) -> tuple[int, str] | None:
  """(bytes free on the fullest device, a clause saying so with {} for the amount): the
  machine's MemAvailable for CPU devices, else bytes_limit - bytes_in_use of the device's
  allocator (GPU, TPU) over this process's devices; None where the device does not say."""
  if devices[0].platform == "cpu":
    return host_available(), "this machine has {} available (MemAvailable)"
  free = []
  for d in devices:
    if d.process_index != jax.process_index():  # another host's: its allocator is not ours
      continue
    try:
      stats = d.memory_stats()
    except (AttributeError, jax.errors.JaxRuntimeError):
      stats = None
    if stats and stats.get("bytes_limit"):
      free.append(int(stats["bytes_limit"]) - int(stats.get("bytes_in_use", 0)))
  if not free:
    return None
  each = "each " if len(devices) > 1 else ""
  return min(free), f"{each}{devices[0].device_kind} has {{}} free (bytes_limit - bytes_in_use)"


def host_available() -> int:
  """The machine's available memory in bytes: /proc/meminfo's MemAvailable, else free pages."""
  try:
    with open("/proc/meminfo") as f:
      for line in f:
        if line.startswith("MemAvailable:"):
          return int(line.split()[1]) * 1024
  except OSError:
    pass
  return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def largest_fitting(fits, low: int, high: int) -> int | None:
  """The largest n in low..high with fits(n) (fits monotone: true up to some n), else None."""
  if low > high or not fits(low):
    return None
  while low < high:
    mid = (low + high + 1) // 2
    low, high = (mid, high) if fits(mid) else (low, mid - 1)
  return low


def fmt(n: float) -> str:
  """Bytes to read: 747 GB, 5.03 TB, 57,200 TB, 12.3 MB."""
  if n >= 1e12:
    return f"{n / 1e12:.3g} TB" if n < 1e15 else f"{n / 1e12:,.0f} TB"
  return f"{n / GB:.3g} GB" if n >= 0.1 * GB else f"{n / 1e6:.3g} MB"


def check(target, drafter, *, method: str, batch: int, max_len: int, nodes: int, devices,
          tree: tuple[str, str, int] | None, cache: tuple[str, int, int, Callable[[int], int]]
          ) -> None:
  """Raises ValueError when the Run's total exceeds the free memory of `devices` (the mesh's,
  or the one device; one that does not report its memory is not checked): the bytes it needs,
  its largest buffers, the bytes there are, and the largest setting that could fit, trying
  first the tree size (unless the caches dominate), then the batch, then the cache.

  tree: (what the run is, e.g. "ddtree with cure.v_max=100000", the tree size's setting,
  its smallest value) where the tree size can change, else None; cache: (the setting that
  sizes the cache, its smallest value, its value, the cache length at a value)."""
  platform = devices[0].platform
  shards = 1 if platform == "cpu" else len(devices)   # CPU devices share the host's memory
  free = available(devices)
  if free is None:
    return
  have, where = free

  def run(b=batch, s=max_len, v=nodes) -> Run:
    return run_of(target, drafter, batch=b, max_len=s, nodes=v, platform=platform)

  def fits(r: Run) -> bool:
    return r.total() / shards <= have

  here = run()
  if fits(here):
    return
  name, low, value, cache_len = cache
  knobs = [("batch_size", lambda n: fits(run(b=n)), 1, batch - 1),
           (name, lambda n: fits(run(s=cache_len(n))), low, value - 1)]
  if tree is not None:
    at = len(knobs) if 2 * here.caches() > here.total() else 0   # the caches dominate: last
    knobs.insert(at, (tree[1], lambda n: fits(run(v=n)), tree[2], nodes - 1))
  advice = ("no smaller tree, batch or cache fits: use a device with more memory, "
            "dtype=bfloat16, or split the model over more devices (mesh.model)")
  for setting, ok, smallest, largest in knobs:
    n = largest_fitting(ok, smallest, largest)
    if n is not None:
      advice = f"the largest {setting} that could fit is {n}"
      break
  per = " per device" if shards > 1 else ""
  buffers = ", ".join(f"{k}: {fmt(b / shards)}" for k, b in here.largest())
  raise ValueError(
      f"{tree[0] if tree else method} at batch {batch} and max_len {max_len} needs "
      f"~{fmt(here.total() / shards)}{per} for its largest buffers ({buffers}); "
      f"{where.format(fmt(have))}; {advice} (a lower bound from the shapes: "
      "cure_jax/runtime/memory.py)")
