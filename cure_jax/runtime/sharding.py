"""Device meshes and partition rules: tensor parallel over heads and MLP, vocab-parallel head.

The mesh has two axes. `model` splits every big matrix Megatron-style: q/k/v and gate/up kernels
on their output (head / intermediate) axis, o_proj and down_proj on their input axis, the
embedding [V, H] and lm_head [H, V] on the vocabulary; norms and the DFlash `fc` are replicated.
`data` splits the batch: each layer's KV cache [B, KVH, S, D] is sharded (data, model, None, None)
and every per-sequence array of the decoding state on its leading batch axis. Parameters are
replicated over `data`.

Qwen3-MoE experts are split on their intermediate axis, like a dense MLP: each expert's
gate/up kernels [E, H, I] on I, down [E, I, H] on I, the router replicated; every chip holds
1/model of every expert. Expert parallelism (whole experts per chip, tokens dispatched with an
all-to-all in a shard_map) was not chosen: a decoding step routes a few dozen token-slots to
8..~80 of 128 experts, which land unevenly on chips (the step waits for the busiest one) and
add two all-to-alls per layer to a step that is latency-bound. Split on I, every chip reads
1/model of each routed expert whatever the routing, and the only collective is the all-reduce
after down_proj that a dense MLP has too, written as a psum in models/moe.py's shard_map. The
model axis must divide moe_intermediate_size.

Nothing in the models or the decoding loop names a device: the jitted prefill / decode take
sharded parameters and are compiled with the state's shardings as outputs, and XLA's sharding
propagation inserts the collectives (an all-reduce after o_proj and after down_proj, a
cross-shard argmax / softmax over the vocabulary-parallel logits, small gathers of the new
tokens' keys and values for the batch-indexed cache writes). No collective has to be written by
hand, and there is no pmap. The one shard_map is TPU attention's
(models/kernels/tpu_attention.py): a Pallas kernel is opaque to sharding propagation, so it runs
per (data, model) shard of the mesh
that decoding.lower_sharded sets, where the caches already are.
"""

from __future__ import annotations

import re
from typing import Sequence

import jax
import numpy as np
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from cure_jax.models.axes import DATA, MODEL

# (pattern searched in the '/'-joined state path, spec, config field that must divide by the
# model axis). First match wins; the paths are those of nnx.split(module) for Qwen3 / Llama
# (target or ar_draft drafter) and DFlash, with or without a leading tuple index.
RULES: tuple[tuple[str, tuple, str | None], ...] = (
    (r"(^|/)embed_tokens/embedding$", (MODEL, None), "vocab_size"),
    (r"(^|/)lm_head/kernel$", (None, MODEL), "vocab_size"),
    (r"(^|/)self_attn/q_proj/kernel$", (None, MODEL), "num_attention_heads"),
    (r"(^|/)self_attn/(k_proj|v_proj)/kernel$", (None, MODEL), "num_key_value_heads"),
    (r"(^|/)self_attn/o_proj/kernel$", (MODEL, None), "num_attention_heads"),
    (r"(^|/)mlp/(gate_proj|up_proj)/kernel$", (None, MODEL), "intermediate_size"),
    (r"(^|/)mlp/down_proj/kernel$", (MODEL, None), "intermediate_size"),
    (r"(^|/)mlp/gate/kernel$", (None, None), None),  # MoE router [H, E]: replicated
    (r"(^|/)mlp/experts/(gate_proj|up_proj)/kernel$", (None, None, MODEL),
     "moe_intermediate_size"),
    (r"(^|/)mlp/experts/down_proj/kernel$", (None, MODEL, None), "moe_intermediate_size"),
    (r"(^|/)fc/kernel$", (None, None), None),        # DFlash feature projection: replicated
    (r"(^|/)[a-z_]*norm/weight$", (None,), None),   # every RMSNorm (incl. q_norm, k_norm)
    (r"(^|/)value_exponents$", (None,), None),      # numerics=invariant's bound on the values
)
CACHE_SPEC = P(DATA, MODEL, None, None)      # each layer's KV cache [B, KVH, S, D]


def make_mesh(data: int, model: int, devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A (data, model) mesh over all devices (every process's, on a multi-host pod) or `devices`."""
  devices = list(jax.devices() if devices is None else devices)
  if data < 1 or model < 1:
    raise ValueError(f"mesh.data={data} and mesh.model={model} must both be >= 1")
  n = len(devices)
  if data * model != n:
    fix = (f"--config.mesh.data={n // model} --config.mesh.model={model}" if n % model == 0
           else f"--config.mesh.data=1 --config.mesh.model={n}")
    raise ValueError(f"mesh.data * mesh.model = {data} * {model} = {data * model}, but {n} "
                     f"{devices[0].platform} device(s) are available; the mesh must use all of "
                     f"them (e.g. {fix})")
  return jax.make_mesh((data, model), (DATA, MODEL), axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=devices)


def _path_str(path) -> str:
  return "/".join(map(str, path))


def spec_for(path, shape: Sequence[int], mesh: Mesh) -> P:
  """The PartitionSpec of one parameter; checks that its sharded axes divide evenly. A kernel
  held as rows (`kernel_rows` [out, in], numerics=invariant) takes its kernel's rule reversed."""
  name = _path_str(path)
  rows = name.endswith("/kernel_rows")
  for pattern, spec, field in RULES:
    if re.search(pattern, name[:-len("_rows")] if rows else name):
      spec = spec[::-1] if rows else spec
      break
  else:
    raise ValueError(f"no partition rule for parameter {name} {tuple(shape)}; add one to RULES "
                     "in cure_jax/runtime/sharding.py")
  if len(spec) != len(shape):
    raise ValueError(f"rule {pattern!r} expects a rank-{len(spec)} tensor, {name} has shape "
                     f"{tuple(shape)}")
  for axis, size in zip(spec, shape):
    if axis is not None and size % mesh.shape[axis]:
      raise ValueError(
          f"cannot split {name} {tuple(shape)} over mesh.{axis}={mesh.shape[axis]}: {size} is not "
          f"divisible (it scales with the model's {field}); use a mesh.{axis} that divides "
          f"{field} and put the other devices on mesh.data")
  return P(*spec)


def check_config(cfg, mesh: Mesh, name: str = "model") -> None:
  """Fails early, naming the dimension, when a model config cannot be split over mesh.model."""
  m = mesh.shape[MODEL]
  moe = getattr(cfg, "moe", None)
  dims = {"num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads}
  if moe is None or not all(moe.sparse_layers):   # some layer has a dense MLP
    dims["intermediate_size"] = cfg.intermediate_size
  if moe is not None:
    dims["moe_intermediate_size"] = moe.intermediate_size
  if hasattr(cfg, "vocab_size"):
    dims["vocab_size"] = cfg.vocab_size
  bad = {k: v for k, v in dims.items() if v % m}
  if bad:
    fits = max(d for d in range(1, m + 1) if all(v % d == 0 for v in dims.values()))
    what = ", ".join(f"{k}={v}" for k, v in bad.items())
    raise ValueError(
        f"the {name} cannot be split over mesh.model={m}: {what} not divisible by {m} (tensor "
        f"parallelism splits attention heads, KV heads, the MLP or experts' intermediate and the "
        f"vocabulary evenly). Use "
        f"a mesh.model that divides {', '.join(f'{k}={v}' for k, v in dims.items())} (e.g. "
        f"--config.mesh.model={fits}) and put the remaining devices on mesh.data.")


def check_models(mesh: Mesh, *models) -> None:
  """check_config for the target and drafter (None entries are skipped)."""
  for name, model in zip(("target", "drafter"), models):
    if model is not None:
      check_config(model.cfg, mesh, name)


def _put(array, sharding: NamedSharding) -> jax.Array:
  """Places a host array straight onto its shards (each process supplies its own devices')."""
  if isinstance(array, jax.Array):
    return jax.device_put(array, sharding)
  array = np.asarray(array)
  return jax.make_array_from_callback(array.shape, sharding, lambda index: array[index])


class Placement:
  """`stream_params(..., placement=placement(mesh))`: each tensor goes straight to its shards.

  `annotate(abstract_state)` gives an abstract state whose leaves carry their shardings, for
  orbax restores (`cure_jax.checkpoints.store.load_checkpoint`).
  """

  def __init__(self, mesh: Mesh):
    self.mesh = mesh

  def sharding(self, path, shape) -> NamedSharding:
    return NamedSharding(self.mesh, spec_for(path, shape, self.mesh))

  def __call__(self, path, array) -> jax.Array:
    return _put(array, self.sharding(path, array.shape))

  def annotate(self, abstract_state: nnx.State) -> nnx.State:
    leaves = []
    for path, var in nnx.to_flat_state(abstract_state):
      x = var.get_value()
      leaves.append((path, var.replace(jax.ShapeDtypeStruct(
          x.shape, x.dtype, sharding=self.sharding(path, x.shape)))))
    return nnx.from_flat_state(leaves)


def placement(mesh: Mesh) -> Placement:
  return Placement(mesh)


def state_shardings(state: nnx.State, mesh: Mesh) -> nnx.State:
  """NamedShardings of a parameter state (same structure) under RULES."""
  place = Placement(mesh)
  return nnx.from_flat_state([(p, v.replace(place.sharding(p, v.get_value().shape)))
                              for p, v in nnx.to_flat_state(state)])


def shard_state(state: nnx.State, mesh: Mesh) -> nnx.State:
  """Moves every parameter of `state` (e.g. nnx.split((target, drafter))[1]) onto its shards."""
  place = Placement(mesh)
  return nnx.from_flat_state([(p, v.replace(place(p, v.get_value())))
                              for p, v in nnx.to_flat_state(state)])


# --- the decoding state -------------------------------------------------------------------------

def decoding_state_shardings(state, mesh: Mesh):
  """Shardings for a decoding.State (or its abstract shape): KV caches CACHE_SPEC, scalars
  replicated, every other array split over `data` on its leading (batch) axis."""
  def spec(path, x):
    if x.ndim == 0:
      return NamedSharding(mesh, P())
    if x.ndim == 4 and len(path) > 1 and getattr(path[-2], "name", None) in ("k", "v"):  # k[i]
      return NamedSharding(mesh, CACHE_SPEC)
    return NamedSharding(mesh, P(DATA, *(None,) * (x.ndim - 1)))
  return jax.tree_util.tree_map_with_path(spec, state)


def batch_multiple(mesh: Mesh) -> int:
  """Batches are padded to a multiple of this (the data axis size)."""
  return mesh.shape[DATA]


def put_batch(array: np.ndarray, mesh: Mesh) -> jax.Array:
  """A host batch [B, ...] onto the mesh, split over `data`."""
  return _put(array, NamedSharding(mesh, P(DATA, *(None,) * (array.ndim - 1))))


def put_replicated(array: np.ndarray, mesh: Mesh) -> jax.Array:
  """A host array every device holds whole (every process supplies the same value)."""
  return _put(np.asarray(array), NamedSharding(mesh, P()))


def put_key(key: jax.Array, mesh: Mesh) -> jax.Array:
  """A PRNG key as replicated raw key data, the form decoding.lower_sharded's prefill takes."""
  return put_replicated(jax.random.key_data(key), mesh)


def to_host(tree):
  """device_get that also works for arrays spread over several processes (multi-host)."""
  def get(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return jax.device_get(x)
    if x.is_fully_replicated:  # this process already holds all of it
      return np.asarray(x.addressable_data(0))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return jax.tree.map(get, tree)
