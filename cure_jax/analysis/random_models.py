"""Small random targets and drafters built directly in JAX, for invariants and losslessness.

Tiny vocabularies make a random drafter agree with a random target often enough (and let a few
alternatives cover most of the vocabulary), so acceptance and repair wins actually happen.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from flax import nnx

from cure_jax.models.dflash import DFlash, DFlashConfig
from cure_jax.models.layers import Rope
from cure_jax.models.moe import MoEConfig
from cure_jax.models.qwen3 import ModelConfig, Qwen3


@dataclasses.dataclass(frozen=True)
class Arch:
  vocab: int = 8
  hidden: int = 32
  layers: int = 3
  heads: int = 4
  kv_heads: int = 2
  head_dim: int = 8
  model_type: str = "qwen3"
  tie: bool = False
  draft_layers: int = 2
  block_size: int = 6
  target_layer_ids: tuple[int, ...] = (0, 2)
  experts: int = 0                    # > 0: a Qwen3-MoE target (model_type qwen3_moe)
  top_k: int = 2
  norm_topk_prob: bool = True
  dense_layers: tuple[int, ...] = ()  # MoE: layers with a dense MLP (HF mlp_only_layers)

  def target_cfg(self) -> ModelConfig:
    moe = None
    if self.experts:
      moe = MoEConfig(self.experts, self.top_k, self.hidden, self.norm_topk_prob,
                      tuple(i not in self.dense_layers for i in range(self.layers)))
    return ModelConfig("qwen3_moe" if self.experts else self.model_type, self.vocab,
                       self.hidden, 2 * self.hidden, self.layers, self.heads, self.kv_heads,
                       self.head_dim, 1e-6, Rope(self.head_dim, 10000.0), self.tie, moe)

  def drafter_cfg(self) -> DFlashConfig:
    return DFlashConfig(self.hidden, 2 * self.hidden, self.draft_layers, self.heads,
                        self.kv_heads, self.head_dim, 1e-6, Rope(self.head_dim, 10000.0),
                        self.block_size, self.vocab - 1, self.target_layer_ids, self.layers)


def hf_configs(target_cfg: ModelConfig, drafter_cfg: DFlashConfig) -> tuple[dict, dict]:
  """config.json dicts (target, DFlash drafter) of these configs, as the converters read them."""
  t, d = target_cfg, drafter_cfg
  common = dict(hidden_size=t.hidden_size, num_attention_heads=t.num_heads,
                num_key_value_heads=t.num_kv_heads, head_dim=t.head_dim, rms_norm_eps=t.rms_eps,
                rope_theta=t.rope.theta)
  target = dict(common, model_type=t.model_type, vocab_size=t.vocab_size,
                intermediate_size=t.intermediate_size, num_hidden_layers=t.num_layers,
                tie_word_embeddings=t.tie_embeddings)
  if t.moe:
    target.update(num_experts=t.moe.num_experts, num_experts_per_tok=t.moe.top_k,
                  moe_intermediate_size=t.moe.intermediate_size,
                  norm_topk_prob=t.moe.norm_topk_prob, decoder_sparse_step=1,
                  mlp_only_layers=[i for i, s in enumerate(t.moe.sparse_layers) if not s])
  drafter = dict(common, model_type="qwen3", intermediate_size=d.intermediate_size,
                 num_hidden_layers=d.num_layers, block_size=d.block_size,
                 num_target_layers=t.num_layers,
                 dflash_config=dict(mask_token_id=d.mask_token_id,
                                    target_layer_ids=list(d.target_layer_ids)))
  return target, drafter


def _perturb(module, seed: int, logit_scale: float):
  """Random norm weights (non-trivial norms) and a sharper output head."""
  graphdef, state = nnx.split(module)
  rng = np.random.default_rng(seed)
  for path, var in nnx.to_flat_state(state):
    if path[-1] == "weight":
      var.set_value(jnp.asarray(1.0 + 0.3 * rng.standard_normal(var.shape), var.dtype))
    if path[0] in ("embed_tokens", "lm_head"):
      var.set_value(var.get_value() * logit_scale)
  return nnx.merge(graphdef, state)


def pair(arch: Arch, seed: int, logit_scale: float = 3.0):
  """A random (target, DFlash drafter) pair; same arch => same compiled code."""
  target = _perturb(Qwen3(arch.target_cfg(), rngs=nnx.Rngs(seed)), seed, logit_scale)
  drafter = _perturb(DFlash(arch.drafter_cfg(), rngs=nnx.Rngs(seed + 10_000)), seed + 1, 1.0)
  return target, drafter


def ar_drafter(arch: Arch, seed: int) -> Qwen3:
  """A one-layer dense random Qwen3 with the target's vocabulary, for naive speculative
  decoding."""
  cfg = dataclasses.replace(arch.target_cfg(), model_type="qwen3" if arch.experts else
                            arch.model_type, num_layers=1, moe=None)
  return _perturb(Qwen3(cfg, rngs=nnx.Rngs(seed + 20_000)), seed + 2, 3.0)


def prompts(seed: int, vocab: int, count: int, lo: int = 3, hi: int = 12) -> list[list[int]]:
  rng = np.random.default_rng(seed)
  return [rng.integers(0, vocab - 1, rng.integers(lo, hi + 1)).tolist() for _ in range(count)]


def write_hf(root, target: Qwen3, drafter: DFlash) -> tuple[Path, Path]:
  """HF directories root/target and root/drafter for a (target, DFlash drafter) pair: the layout
  the converters read, so a random pair goes through the same loading path as a real one."""
  from cure_jax.checkpoints import qwen3, store
  root = Path(root)
  target_config, drafter_config = hf_configs(target.cfg, drafter.cfg)
  store.export_hf(nnx.state(target), root / "target", qwen3.hf_name, target_config)
  store.export_hf(nnx.state(drafter), root / "drafter", lambda p: store.hf_name(p),
                       drafter_config)
  return root / "target", root / "drafter"
