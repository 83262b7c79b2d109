"""A CPU decoding step pays for the context it holds, not the cache it could hold: the compiled
loop copies no layer's cache, and attention reads the cache in a loop of blocks, not whole."""

import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from cure_jax.analysis import random_models
from cure_jax.methods.base import Spec
from cure_jax.runtime import decoding, xla_options

ARCH = random_models.Arch()
MAX_LEN = 1024


def _decode_program(method: str, options: dict) -> str:
  target, drafter = random_models.pair(ARCH, 0)
  graphdef, params = nnx.split((target, None if method == "ar" else drafter))
  spec = Spec(method=method, max_new_tokens=8, max_len=MAX_LEN,
              block_size=1 if method == "ar" else ARCH.block_size, mask_token_id=ARCH.vocab - 1,
              feature_layers=() if method == "ar" else ARCH.drafter_cfg().feature_layers)
  prompt = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
  state = jax.eval_shape(lambda p: decoding.prefill(graphdef, params, p, jnp.asarray([5]),
                                                    spec=spec), prompt)
  lowered = decoding.decode.lower(graphdef, params, state, spec=spec)
  return xla_options.compile_with(lowered, options).as_text()


def _cache_copies(hlo: str) -> int:
  """Copies of a whole layer cache [1, KVH, MAX_LEN, D] in the compiled program."""
  shape = rf"f32\[1,{ARCH.kv_heads},{MAX_LEN},{ARCH.head_dim}\]"
  return len(re.findall(rf"= {shape}\{{[\d,]+\}} copy\(", hlo))


@pytest.mark.parametrize("method", ["ar", "chain"])
def test_the_cpu_loop_copies_no_cache(method):
  """With the CPU platform's options (copy insertion by region analysis) no layer's cache is
  copied."""
  assert jax.default_backend() == "cpu"
  assert _cache_copies(_decode_program(method, xla_options.platform_options("cpu"))) == 0


def test_without_the_cpu_options_target_only_decoding_copies_every_cache():
  """What the option removes: XLA:CPU's default copy insertion copies each layer's cache twice
  an ar iteration (the loop body reads it, then updates it in place), so a step's cost
  followed the cache's size."""
  assert _cache_copies(_decode_program("ar", {})) >= 2 * 2 * ARCH.layers   # k and v, twice


def test_the_cpu_attention_reads_the_cache_in_blocks():
  """No op of the compiled loop reads a layer's cache whole in a transposed copy, as the dense
  form's score product did; the blocks are dynamic slices inside a loop."""
  hlo = _decode_program("ar", xla_options.platform_options("cpu"))
  transposed = rf"f32\[(1,)?{ARCH.kv_heads},{ARCH.head_dim},{MAX_LEN}\]"
  assert not re.search(rf"= {transposed}", hlo)
  assert re.search(r"dynamic-slice", hlo)


def test_user_options_win_over_the_platform_defaults():
  key = "xla_cpu_copy_insertion_use_region_analysis"
  assert xla_options.platform_options("cpu")[key] is True
  assert xla_options.platform_options("cpu", {key: False})[key] is False
  tpu = "xla_tpu_msa_inefficient_use_to_copy_ratio"
  assert xla_options.platform_options("tpu")[tpu] == 1
  assert xla_options.platform_options("tpu", {tpu: 2})[tpu] == 2
  assert xla_options.platform_options("rocm") == {}                    # a platform without defaults
