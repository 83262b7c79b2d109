"""The decoding program lowers for GPU: `jax.export` for the `cuda` platform on a CPU host.

No GPU is needed to lower (only to compile), so this catches a primitive without a CUDA lowering,
a host callback or a CPU-only custom call in prefill or the decode loop before a researcher's
GPU run does. Pallas lowers gpu_attention's kernel to Triton IR here too, so a kernel Triton
cannot take fails here; every layer's cache attention is that kernel in the decode loop.
"""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from cure_jax.runtime import decoding
from cure_jax.analysis import random_models
from cure_jax.tree import repair
from cure_jax.runtime.generation import decoding_spec

ARCH = random_models.Arch(head_dim=16)      # a head Triton's dot takes (gpu_attention.tiles)
TRITON = "__gpu$xla.gpu.triton"


@pytest.mark.parametrize("method", ["ar", "chain", "cure"])
def test_prefill_and_decode_export_for_cuda(method):
  target, drafter = random_models.pair(ARCH, 0)
  graphdef, params = nnx.split((target, drafter if method != "ar" else None))
  k = ARCH.block_size if method != "ar" else 1
  cure = repair.RepairConfig(max_depth=k - 1, v_max=16) if method == "cure" else None
  spec = decoding_spec(method, drafter, 16, 64, (), k, cure)
  prompt = jax.ShapeDtypeStruct((2, 8), jnp.int32)
  plen = jax.ShapeDtypeStruct((2,), jnp.int32)
  key = jax.eval_shape(jax.random.key, 0)

  def prefill(p, x, n, key):
    return decoding.prefill(graphdef, p, x, n, key, spec=spec)

  def decode(p, st):
    return decoding.decode(graphdef, p, st, spec=spec)

  state = jax.eval_shape(prefill, params, prompt, plen, key)
  # a Triton kernel's IR carries no compatibility guarantee across jax versions: allowed here
  export = lambda f: jax.export.export(                                     # noqa: E731
      f, platforms=("cuda",),
      disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(TRITON)])
  pre = export(jax.jit(prefill))(params, prompt, plen, key)
  dec = export(jax.jit(decode, donate_argnums=1))(params, state)
  assert pre.platforms == dec.platforms == ("cuda",)
  text = dec.mlir_module()
  assert text.count("stablehlo.while") == 1          # the whole generation loop, on device
  calls = set(re.findall(r"custom_call @([\w$.]+)", text + pre.mlir_module()))
  assert not {c for c in calls if "cpu" in c.lower() or "callback" in c.lower()}, calls
  layers = ARCH.layers + (ARCH.draft_layers if method != "ar" else 0)
  assert text.count(f"custom_call @{TRITON}") >= layers       # the cache attention of each layer
  state_avals = [jax.core.ShapedArray(x.shape, x.dtype) for x in jax.tree.leaves(state)]
  n_params = len(jax.tree.leaves(params))
  assert list(dec.in_avals[n_params:]) == state_avals
  assert list(dec.out_avals) == state_avals           # the donated state comes back in place
