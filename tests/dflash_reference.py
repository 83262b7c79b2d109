"""Random tiny target + DFlash drafter pairs built with the public `dflash` wheel.

The wheel is the numerical reference for our drafter and chain loop; these helpers give tests a
transformers Qwen3 target and a `DFlashDraftModel` that fit each other, with non-trivial norm
weights, saved as HF directories the way their authors' tools save them.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from pathlib import Path
from unittest import mock

import torch
from dflash import model as dflash_model
from dflash.model import DFlashDraftModel, dflash_generate, extract_context_feature
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM


@dataclasses.dataclass(frozen=True)
class PairSpec:
  """Shapes of one target/drafter pair; the drafter shares the target's width and vocabulary."""

  vocab_size: int = 96
  hidden_size: int = 48
  num_heads: int = 4
  num_kv_heads: int = 2
  head_dim: int = 12
  target_layers: int = 4
  draft_layers: int = 2
  target_layer_ids: tuple[int, ...] = (1, 3)
  block_size: int = 4
  draft_rope_theta: float = 10000.0
  # > 0 adds this multiple of one shared random vector to every token embedding and gives both
  # models the same final norm: their hidden states then lean the same way, so they often pick
  # the same tokens and drafts get accepted.
  shared_embedding: float = 0.0
  seed: int = 0


@dataclasses.dataclass
class Pair:
  spec: PairSpec
  target: Qwen3ForCausalLM
  drafter: DFlashDraftModel
  target_dir: Path
  drafter_dir: Path


def _common(spec: PairSpec) -> dict:
  return dict(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
              intermediate_size=2 * spec.hidden_size, num_attention_heads=spec.num_heads,
              num_key_value_heads=spec.num_kv_heads, head_dim=spec.head_dim, rms_norm_eps=1e-6,
              initializer_range=0.1, max_position_embeddings=256, tie_word_embeddings=False)


def _perturb_norms(model: torch.nn.Module) -> None:
  """Moves every RMSNorm weight off its all-ones initialisation, so a missing norm shows, and
  doubles the q/k norms: sharper attention, so that a wrong position or mask changes tokens."""
  with torch.no_grad():
    for name, param in model.named_parameters():
      if "norm" in name:
        param.add_(0.3 * torch.randn_like(param))
      if "q_norm" in name or "k_norm" in name:
        param.mul_(2.0)


def build_pair(spec: PairSpec, out_dir: str | Path) -> Pair:
  """A random float32 pair, saved with save_pretrained under out_dir/{target,drafter}; the mask
  token is the last vocabulary id."""
  torch.manual_seed(spec.seed)
  target = Qwen3ForCausalLM(Qwen3Config(num_hidden_layers=spec.target_layers,
                                        **_common(spec))).eval()
  draft_cfg = Qwen3Config(
      num_hidden_layers=spec.draft_layers, block_size=spec.block_size,
      num_target_layers=spec.target_layers,
      dflash_config={"mask_token_id": spec.vocab_size - 1,
                     "target_layer_ids": list(spec.target_layer_ids)},
      rope_parameters={"rope_type": "default", "rope_theta": spec.draft_rope_theta},
      architectures=["DFlashDraftModel"], **_common(spec))
  drafter = DFlashDraftModel(draft_cfg).eval()
  _perturb_norms(target)
  _perturb_norms(drafter)
  if spec.shared_embedding:
    with torch.no_grad():
      emb = target.get_input_embeddings().weight
      emb.add_(spec.shared_embedding * emb.std() * torch.randn(emb.shape[1]))
      drafter.norm.weight.copy_(target.model.norm.weight)
  out_dir = Path(out_dir)
  target.save_pretrained(out_dir / "target")
  drafter.save_pretrained(out_dir / "drafter")
  return Pair(spec, target, drafter, out_dir / "target", out_dir / "drafter")


def add_model_prefix(hf_dir: str | Path) -> None:
  """Rewrites a saved drafter's tensors under `model.`, as some published exports name them."""
  path = Path(hf_dir) / "model.safetensors"
  tensors = load_file(str(path))
  save_file({f"model.{k}": v for k, v in tensors.items()}, str(path), metadata={"format": "pt"})


@torch.no_grad()
def reference_features(pair: Pair, ids: torch.Tensor) -> torch.Tensor:
  """The wheel's context features [B, T, n*H] of ids [B, T]: extract_context_feature of the
  target's hidden states."""
  hidden = pair.target(ids, output_hidden_states=True).hidden_states
  return extract_context_feature(hidden, pair.drafter.target_layer_ids)


@torch.no_grad()
def reference_block_logits(pair: Pair, features: torch.Tensor, anchor: int,
                           verify_size: int) -> torch.Tensor:
  """The wheel's draft logits [1, verify_size-1, V] for a block after context features [1, T, n*H].

  The block is [anchor, mask...] embedded by the target, at positions T..T+verify_size-1.
  """
  target, drafter = pair.target, pair.drafter
  t = features.shape[1]
  block = torch.full((1, verify_size), drafter.mask_token_id, dtype=torch.long)
  block[0, 0] = anchor
  out = drafter(target_hidden=features, noise_embedding=target.get_input_embeddings()(block),
                position_ids=torch.arange(t + verify_size)[None])
  return drafter.compute_logits(out[:, 1:], target.lm_head)


def reference_generate(pair: Pair, prompt: list[int], max_new_tokens: int,
                       stop_ids: list[int] | None = None) -> tuple[list[int], list[int]]:
  """The wheel's greedy chain decode: (generated ids, acceptance_lengths per iteration).

  Its stats timer calls torch.cuda.synchronize, so on CPU it is swapped for a plain clock; the
  transformers deprecation warnings its target calls raise are not ours to act on.
  """
  with mock.patch.object(dflash_model, "_cuda_time", time.perf_counter), warnings.catch_warnings():
    warnings.simplefilter("ignore", FutureWarning)
    out = dflash_generate(pair.drafter, pair.target, torch.tensor([prompt]), max_new_tokens,
                          stop_token_ids=stop_ids, temperature=0.0, return_stats=True)
  return out.output_ids[0, len(prompt):].tolist(), list(out.acceptance_lengths)
