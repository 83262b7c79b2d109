"""The AR drafter's distillation step (cure_jax/training/ar_drafter.py, experiments.train_ar_drafter)
on a small random target whose layer sizes the GPU layer kernels take: the step differentiates
the drafter's layers, so they must run as XLA's ops."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cure_jax.analysis import random_models
from cure_jax.models.kernels import gpu_layer
from cure_jax.models.qwen3 import Qwen3
from cure_jax.training import ar_drafter

ARCH = random_models.Arch(vocab=64, hidden=64, layers=2, heads=2, kv_heads=1, head_dim=32)


def test_a_training_step_lowers_the_loss_of_a_drafter_cut_from_the_target():
  target = Qwen3(ARCH.target_cfg(), jnp.float32, rngs=nnx.Rngs(0))
  assert gpu_layer.takes(16, ARCH.hidden, 2 * ARCH.hidden, ARCH.head_dim)   # the kernels' sizes
  drafter = ar_drafter.init_drafter(target, 1, [0])
  rng = np.random.default_rng(0)
  batch = dict(tokens=rng.integers(0, ARCH.vocab, (2, 16)), labels=rng.integers(0, 8, (2, 16)),
               seg=np.repeat([[1] * 10 + [2] * 6], 2, axis=0),
               positions=np.repeat([list(range(10)) + list(range(6))], 2, axis=0))
  batch = {k: jnp.asarray(v, jnp.int32) for k, v in batch.items()}
  head = drafter.embed_tokens.embedding[...]
  remap = jnp.arange(ARCH.vocab, dtype=jnp.int32)
  opt = ar_drafter.optimizer(drafter, 1e-2, 0.0)
  losses = [float(ar_drafter.train_step(drafter, opt, head, remap, batch, jnp.float32(1e-2))[0])
            for _ in range(5)]
  assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
  embedding = jax.device_get(drafter.embed_tokens.embedding[...])
  assert np.array_equal(embedding, jax.device_get(target.embed_tokens.embedding[...]))  # frozen
