"""Host-side driver: batches prompts, compiles once per shape, times, and unpacks results."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cure_jax import decoding, repair
from cure_jax.drafting import Spec
from cure_jax.models.dflash import DFlash

PROMPT_BUCKET = 32
_EXECUTABLES: dict[tuple, tuple] = {}  # (graphdef, Spec, batch, bucket) -> (prefill, decode)


@dataclasses.dataclass
class Result:
  output_ids: list[int]
  iterations: int
  accept_lengths: list[int]
  stats: list[dict]
  tpot_ms: float
  decode_s: float


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


class Generator:
  """Decodes token-id prompts with one method; construct once, call `generate` many times."""

  def __init__(self, target, drafter=None, *, method: str, max_new_tokens: int,
               stop_ids=(), block_size: int | None = None, cure: repair.RepairConfig | None = None,
               max_len: int | None = None):
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    if method != "ar" and drafter is None:
      raise ValueError(f"method={method!r} needs a drafter (set drafter.path)")
    self.target, self.drafter = target, (drafter if method != "ar" else None)
    self.method = method
    self.max_new_tokens = max_new_tokens
    self.stop_ids = tuple(int(i) for i in stop_ids)
    self.max_len = max_len
    if method in ("chain", "cure"):
      if not isinstance(drafter, DFlash):
        raise ValueError(f"method={method!r} needs a DFlash block drafter")
      drafter.cfg.check_against(target.cfg)
      block_size = block_size or drafter.cfg.block_size
    elif method == "ar_draft":
      if drafter.cfg.vocab_size != target.cfg.vocab_size:
        raise ValueError(f"ar_draft drafter vocab {drafter.cfg.vocab_size} != target vocab "
                         f"{target.cfg.vocab_size}: it must share the target's tokenizer")
      block_size = block_size or 5
    else:
      block_size = 1
    if block_size < 1:
      raise ValueError(f"block size {block_size} must be >= 1")
    if method == "cure":
      cure = cure or repair.RepairConfig(max_depth=block_size - 1)
      cure.validate(block_size)
    self.block_size = block_size
    self.cure = cure if method == "cure" else None
    self.graphdef, self.params = nnx.split((self.target, self.drafter))
    self.compile_s: dict[tuple, float] = {}

  def spec(self, max_len: int) -> Spec:
    return Spec(method=self.method, max_new_tokens=self.max_new_tokens, max_len=max_len,
                stop_ids=self.stop_ids, block_size=self.block_size,
                mask_token_id=self.drafter.cfg.mask_token_id if self.method in ("chain", "cure")
                else 0,
                feature_layers=self.drafter.cfg.feature_layers if self.method in ("chain", "cure")
                else (), cure=self.cure)

  def cache_len(self, prompt_len: int) -> int:
    """The static cache length for a prompt bucket; checks the user's max_len if given."""
    need = prompt_len + self.max_new_tokens - 1
    if self.max_len is None:
      return _round_up(need, 64)
    if prompt_len > self.max_len:
      raise ValueError(f"a prompt of {prompt_len} tokens is longer than the cache "
                       f"(max_len={self.max_len}): shorten the prompt or raise max_len")
    if need > self.max_len:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} runs past the cache: prompt "
                       f"{prompt_len} + {self.max_new_tokens} new tokens needs max_len >= {need} "
                       f"(got {self.max_len}); raise max_len or lower max_new_tokens")
    return self.max_len

  def _executables(self, batch: int, bucket: int, max_len: int):
    """Compiled prefill and decode, shared by every Generator with the same model structure."""
    spec = self.spec(max_len)
    key = (self.graphdef, spec, batch, bucket)
    if key not in _EXECUTABLES:
      t0 = time.perf_counter()
      prompt = jax.ShapeDtypeStruct((batch, bucket), jnp.int32)
      plen = jax.ShapeDtypeStruct((batch,), jnp.int32)
      pre = decoding.prefill.lower(self.graphdef, self.params, prompt, plen, spec=spec).compile()
      state = jax.eval_shape(lambda p, l: decoding.prefill(self.graphdef, self.params, p, l,
                                                           spec=spec), prompt, plen)
      dec = decoding.decode.lower(self.graphdef, self.params, state, spec=spec).compile()
      _EXECUTABLES[key] = (pre, dec)
      self.compile_s[(batch, bucket, max_len)] = time.perf_counter() - t0
    return _EXECUTABLES[key]

  def generate(self, prompts: list[list[int]]) -> list[Result]:
    """Decodes one batch of prompts (lists of ids); returns one Result per prompt."""
    if not prompts or any(len(p) == 0 for p in prompts):
      raise ValueError("every prompt needs at least one token")
    longest = max(len(p) for p in prompts)
    max_len = self.cache_len(longest)
    bucket = _round_up(longest, PROMPT_BUCKET)
    pre, dec = self._executables(len(prompts), bucket, max_len)
    padded = np.zeros((len(prompts), bucket), np.int32)
    for i, p in enumerate(prompts):
      padded[i, :len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    state = pre(self.params, jnp.asarray(padded), jnp.asarray(lengths))
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = dec(self.params, state)
    state = jax.device_get(state)
    decode_s = time.perf_counter() - t0
    return [self._unpack(state, i, decode_s) for i in range(len(prompts))]

  def _unpack(self, state, i: int, decode_s: float) -> Result:
    n = int(state.produced[i])
    iters = int(state.iterations[i])
    st = state.stats
    stats = [dict(accept_lengths=int(st.accept_lengths[i, t]),
                  nodes_verified=int(st.nodes_verified[i, t]),
                  winning_branch=int(st.winning_branch[i, t]),
                  ufp_positions=[int(x) for x in st.ufp_positions[i, t] if x >= 0],
                  ufp_margins=[float(m) for x, m in zip(st.ufp_positions[i, t],
                                                        st.ufp_margins[i, t]) if x >= 0],
                  branches=[int(b) for x, b in zip(st.ufp_positions[i, t], st.branches[i, t])
                            if x >= 0],
                  repair_gain=int(st.repair_gain[i, t])) for t in range(iters)]
    return Result(output_ids=[int(x) for x in state.tokens[i, :n]], iterations=iters,
                  accept_lengths=[s["accept_lengths"] for s in stats], stats=stats,
                  tpot_ms=1000.0 * decode_s / max(n - 1, 1), decode_s=decode_s)
