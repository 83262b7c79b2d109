"""A repair that wins, and the drafter state after it (the paper's resync ablation)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cure_jax.methods import block
from cure_jax.methods.base import Spec, depth_limit
from cure_jax.runtime import decoding
from cure_jax.tree import repair
from cure_jax.analysis import random_models

ARCH = random_models.Arch()
MAX_NEW = 16


def _spec(method, resync=True):
  k = ARCH.block_size
  cure = repair.RepairConfig(tau_margin=1e9, v_max=40, max_depth=k - 1, resync=resync)
  return Spec(method=method, max_new_tokens=MAX_NEW, max_len=64, block_size=k,
              mask_token_id=ARCH.vocab - 1, feature_layers=ARCH.drafter_cfg().feature_layers,
              cure=cure if method == "cure" else None)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _one_iteration(graphdef, params, state, spec):
  target, drafter = nnx.merge(graphdef, params)
  return decoding.iteration(target, drafter, spec, state)


@functools.partial(jax.jit, static_argnames=("graphdef", "spec"))
def _next_draft(graphdef, params, state, spec):
  target, drafter = nnx.merge(graphdef, params)
  limit = depth_limit(spec, state.cache.lengths, state.produced)
  logits = block.main_logits(target, drafter, state.dcache, spec, state.anchor,
                             state.cache.lengths, limit)
  return jnp.argmax(logits, axis=-1), logits


def _first_iteration(graphdef, params, prompt, spec):
  ids = jnp.asarray([prompt], jnp.int32)
  state = decoding.prefill(graphdef, params, ids, jnp.asarray([len(prompt)]), spec=spec)
  return _one_iteration(graphdef, params, state, spec)


def _find_winning_repair():
  """Searches random pairs for a first iteration where a repair path beats branch 0."""
  for seed in range(60):
    target, drafter = random_models.pair(ARCH, seed)
    graphdef, params = nnx.split((target, drafter))
    for prompt in random_models.prompts(seed, ARCH.vocab, 4):
      state = _first_iteration(graphdef, params, prompt, _spec("cure"))
      if int(state.stats.winning_branch[0, 0]) > 0:
        return graphdef, params, prompt, state
  raise AssertionError("no winning repair found in 240 random cases")


def test_repair_wins_and_resync_matches_a_fresh_drafter():
  graphdef, params, prompt, cure_state = _find_winning_repair()
  chain_state = _first_iteration(graphdef, params, prompt, _spec("chain"))
  cure_n = int(cure_state.stats.accept_lengths[0, 0])
  chain_n = int(chain_state.stats.accept_lengths[0, 0])
  assert cure_n > chain_n
  assert int(cure_state.stats.repair_gain[0, 0]) == cure_n - chain_n

  # A drafter run fresh on every committed token but the anchor.
  produced = int(cure_state.produced[0])
  committed = prompt + [int(t) for t in cure_state.tokens[0, :produced - 1]]
  fresh = decoding.prefill(graphdef, params, jnp.asarray([committed], jnp.int32),
                           jnp.asarray([len(committed)]), spec=_spec("cure"))
  assert int(fresh.anchor[0]) == int(cure_state.anchor[0])
  fresh = fresh.replace(produced=cure_state.produced)
  want_tokens, want_logits = _next_draft(graphdef, params, fresh, _spec("cure"))
  got_tokens, got_logits = _next_draft(graphdef, params, cure_state, _spec("cure"))
  np.testing.assert_array_equal(got_tokens, want_tokens)
  np.testing.assert_allclose(got_logits, want_logits, atol=1e-4)

  stale = _first_iteration(graphdef, params, prompt, _spec("cure", resync=False))
  _, stale_logits = _next_draft(graphdef, params, stale, _spec("cure", resync=False))
  assert np.abs(np.asarray(stale_logits) - np.asarray(want_logits)).max() > 1e-2
