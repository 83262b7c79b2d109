"""The generation loop never returns to the host between iterations."""

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

from cure_jax.runtime import decoding
from cure_jax.tree import repair
from cure_jax.methods.base import Spec
from cure_jax.analysis import random_models

ARCH = random_models.Arch()


@pytest.mark.parametrize("method", ["ar", "chain", "cure"])
def test_one_compiled_loop_without_host_transfers(method):
  target, drafter = random_models.pair(ARCH, 0)
  graphdef, params = nnx.split((target, None if method == "ar" else drafter))
  spec = Spec(method=method, max_new_tokens=24, max_len=64,
              block_size=1 if method == "ar" else ARCH.block_size, mask_token_id=ARCH.vocab - 1,
              feature_layers=() if method == "ar" else ARCH.drafter_cfg().feature_layers,
              cure=repair.RepairConfig(tau_margin=1e9, v_max=24, max_depth=ARCH.block_size - 1)
              if method == "cure" else None)
  prompt = jnp.asarray([[1, 2, 3, 4, 5]], jnp.int32)
  state = decoding.prefill(graphdef, params, prompt, jnp.asarray([5]), spec=spec)
  hlo = decoding.decode.lower(graphdef, params, state, spec=spec).as_text()
  assert hlo.count("stablehlo.while") >= 1
  assert "callback" not in hlo                       # no host callbacks inside the loop
  with jax.transfer_guard("disallow"):               # no implicit host<->device copies
    out = decoding.decode(graphdef, params, state, spec=spec)
    jax.block_until_ready(out)
  assert int(out.step) > 3                            # many iterations, one dispatch
  assert int(out.produced[0]) == 24
