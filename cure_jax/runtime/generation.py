"""Host-side driver: batches prompts, compiles once per shape, times, and unpacks results."""

from __future__ import annotations

import dataclasses
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from cure_jax import methods
from cure_jax.methods.base import Spec
from cure_jax.runtime import (cost_curve, decoding, draft_vocab as draft_vocab_lib, memory,
                              sharding, xla_options)
from cure_jax.tree import controller, repair
from cure_jax.tree.sampling import Sampling

PROMPT_BUCKET = 32
LONG_PROMPT = 2048
PREFILL_CHUNK = Spec.prefill_chunk   # prompt tokens per prefill step on other platforms
# Prompt tokens per prefill step by platform, for a chunk of 0 (measured, WORKSPACE 2026-12-04):
# an H200 prefilled 32,768 tokens of Qwen3-8B + DFlash in 2.04 / 1.94 / 1.89 s in chunks of
# 512 / 1024 / 2048; on a v5e 2x2 (model=4) chunks of 2048 move 2.13 TB per chip against 0.34 TB
# in chunks of 512, the most rows the TPU kernel takes; on a CPU memory grows with chunk x max_len.
PREFILL_CHUNKS = {"gpu": 2048, "tpu": 512, "cpu": 512}
_EXECUTABLES: dict[tuple, tuple] = {}  # (graphdef, Spec, batch, bucket, mesh) -> (prefill, decode)


def release_compiled() -> None:
  """Drops every compiled prefill/decode pair. Each XLA:CPU executable holds hundreds of memory
  mappings; a process that compiles many model shapes (the test suite) would otherwise reach
  the kernel's vm.max_map_count (65530), where XLA crashes in its next compile."""
  _EXECUTABLES.clear()


@dataclasses.dataclass
class Result:
  output_ids: list[int]
  iterations: int
  accept_lengths: list[int]
  stats: list[dict]
  tpot_ms: float
  decode_s: float      # the whole batch's decode time
  batch_size: int = 1  # prompts decoded together (the batch's time is theirs together)


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def platform_prefill_chunk(chunk: int, platform: str) -> int:
  """`chunk`, or for 0 the measured default of `platform` (a jax platform name)."""
  if chunk < 0:
    raise ValueError(f"prefill_chunk={chunk} must be >= 1 (prompt tokens per prefill step), or "
                     "0 for the platform's default")
  if chunk:
    return chunk
  return PREFILL_CHUNKS.get("gpu" if platform in ("cuda", "rocm") else platform, PREFILL_CHUNK)


def prompt_bucket(length: int) -> int:
  """Padded prompt length, so that a benchmark's prompts compile a handful of shapes rather
  than one per length: a power of two (at least PROMPT_BUCKET) up to LONG_PROMPT, a multiple of
  LONG_PROMPT / 2 above it. The cache is sized to the bucket; powers of two all the way would
  leave up to half of a long prompt's cache unused (a 6,000-token prompt's 8,192: 94 MB of the
  embedded default's float32 cache)."""
  if length > LONG_PROMPT:
    return _round_up(length, LONG_PROMPT // 2)
  return max(PROMPT_BUCKET, 1 << (length - 1).bit_length())


def decoding_spec(method: str, drafter, max_new_tokens: int, max_len: int, stop_ids=(),
                  block_size: int = 1, cure: repair.RepairConfig | None = None,
                  sampling: Sampling = Sampling(), prefill_chunk: int = PREFILL_CHUNK,
                  drafter_window: int = 0, draft_vocab: tuple[int, ...] = (),
                  auto: controller.Settings | None = None) -> Spec:
  """The static Spec of a run; the method takes what it needs from the drafter (a DFlash
  drafter's mask token and target layers). Works on abstract modules (nnx.eval_shape) too."""
  impl = methods.get(method)
  return Spec(method=method, max_new_tokens=max_new_tokens, max_len=max_len,
              stop_ids=tuple(stop_ids), block_size=block_size,
              cure=cure if impl.tree_config else None, sampling=sampling,
              prefill_chunk=prefill_chunk,
              drafter_window=drafter_window if impl.drafter_kind == "block" else 0,
              draft_vocab=tuple(draft_vocab) if impl.drafter_kind == "block" else (),
              auto=auto if impl.controlled else None, **impl.spec_fields(drafter))


class Generator:
  """Decodes token-id prompts with one method; construct once, call `generate` many times.

  With a `mesh` (cure_jax.runtime.sharding.make_mesh) the parameters are sharded by the partition
  rules and each batch is padded to a multiple of mesh.data and split over it. A controlled
  method (auto) takes its budgets from `auto`; without costs there, the device's cost curve is
  timed once per batch size (cure_jax/runtime/cost_curve.py). A block drafter with a
  `draft_vocab` (ascending token ids, cure_jax/runtime/draft_vocab.py) proposes only those.
  """

  def __init__(self, target, drafter=None, *, method: str, max_new_tokens: int,
               stop_ids=(), block_size: int | None = None, cure: repair.RepairConfig | None = None,
               max_len: int | None = None, mesh=None, sampling: Sampling = Sampling(),
               seed: int = 0, compiler_options: dict[str, str] | None = None,
               prefill_chunk: int = 0, drafter_window: int = 0,
               draft_vocab: tuple[int, ...] = (), auto: controller.Settings | None = None):
    impl = methods.get(method)
    if max_new_tokens < 1:
      raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1")
    platform = (mesh.devices.flat[0] if mesh is not None else jax.devices()[0]).platform
    prefill_chunk = platform_prefill_chunk(prefill_chunk, platform)
    if drafter_window < 0:
      raise ValueError(f"drafter.window={drafter_window} must be >= 0 (context positions the "
                       "DFlash drafter sees; 0 = all)")
    self.prefill_chunk, self.drafter_window = prefill_chunk, drafter_window
    self.draft_vocab = tuple(draft_vocab)
    draft_vocab_lib.check(self.draft_vocab, target.cfg.vocab_size)
    if impl.drafter_kind and drafter is None:
      raise ValueError(f"method={method!r} needs a drafter (set drafter.path)")
    self.target, self.drafter = target, (drafter if impl.drafter_kind else None)
    self.method = method
    self.max_new_tokens = max_new_tokens
    self.stop_ids = tuple(int(i) for i in stop_ids)
    self.max_len = max_len
    impl.check(target, self.drafter)
    block_size = impl.block_size(self.drafter, block_size)
    if block_size < 1:
      raise ValueError(f"block size {block_size} must be >= 1")
    self.auto = None
    self._target_only: set[int] = set()   # batch sizes where auto decodes target-only
    # per batch size, what auto's earlier calls learned: (spacing of looks at the drafter,
    # iterations until the next one), carried from call to call (controller.update)
    self._looks: dict[int, tuple[int, int]] = {}
    if impl.controlled:  # the tree holds the largest budget
      self.auto = auto or controller.Settings()
      self.auto.validate()
      if self.auto.budgets[-1] < block_size:
        raise ValueError(f"auto.budgets={self.auto.budgets}: the largest budget must hold the "
                         f"drafter's block ({block_size} nodes)")
      cure = dataclasses.replace(cure or repair.RepairConfig(max_depth=block_size - 1),
                                 v_max=self.auto.budgets[-1])
    cure = impl.tree_settings(target, block_size, cure, len(self.draft_vocab))
    self.block_size = block_size
    sampling.validate()
    self.sampling = sampling
    self.seed = seed
    self.cure = cure
    self.graphdef, self.params = nnx.split((self.target, self.drafter))
    self.mesh = mesh
    if mesh is not None:
      sharding.check_models(mesh, self.target, self.drafter)
      self.params = sharding.shard_state(self.params, mesh)
    self.compile_s: dict[tuple, float] = {}
    self._fits: set[tuple[int, int]] = set()   # (batch, max_len) the memory check passed
    # XLA options for this Generator's compiles (e.g. GPU GEMM settings to time against the
    # defaults); part of the executables' key
    self.compiler_options = tuple(sorted((compiler_options or {}).items()))

  def _configured(self, max_len: int, batch: int) -> Spec:
    """The configured method's Spec, auto's costs (if unset) timed on the device at `batch`."""
    spec = decoding_spec(self.method, self.drafter, self.max_new_tokens, max_len, self.stop_ids,
                         self.block_size, self.cure, self.sampling, self.prefill_chunk,
                         self.drafter_window, self.draft_vocab, self.auto)
    if spec.auto is not None and not spec.auto.costs:
      seconds = cost_curve.costs(self.graphdef, self.params, spec, batch)
      spec = dataclasses.replace(spec, auto=dataclasses.replace(spec.auto, costs=seconds))
    return spec

  def auto_costs(self, max_len: int, batch: int = 1) -> tuple[float, ...]:
    """auto's cost curve at `batch`: seconds per iteration at each of auto.budgets, as given
    or as timed on this device (once, then cached); whichever program the next call runs."""
    if self.auto is None:
      raise ValueError(f"method={self.method!r} has no cost curve: only auto has one")
    return self._configured(max_len, batch).auto.costs

  def spec(self, max_len: int, batch: int = 1) -> Spec:
    """The run's Spec; costs left unset (auto's, the online budget's) come from the device at
    this batch size. auto runs the target-only program in a call where drafting cannot pay or
    no look at the drafter falls due."""
    spec = self._configured(max_len, batch)
    if spec.auto is not None and spec.auto.fallback and not controller.can_pay(spec.auto):
      if batch not in self._target_only:
        self._target_only.add(batch)
        print(f"cure_jax: auto at batch {batch}: no node budget of {spec.auto.budgets} can "
              f"beat plain steps on costs {[round(c, 4) for c in spec.auto.costs]} even if "
              "every draft were accepted; decoding target-only")
      spec = decoding_spec("ar", None, self.max_new_tokens, max_len, self.stop_ids,
                           sampling=self.sampling, prefill_chunk=self.prefill_chunk)
    elif (spec.auto is not None and spec.auto.fallback and
          self._next_look(spec, batch) > self._last_look(spec)):
      # no look at the drafter falls inside this call: plain steps all through, which the
      # target-only program takes without the controlled loop's overhead
      self._looks.setdefault(batch, (spec.auto.explore_interval, 0))
      spec = decoding_spec("ar", None, self.max_new_tokens, max_len, self.stop_ids,
                           sampling=self.sampling, prefill_chunk=self.prefill_chunk)
    if spec.online and not any(spec.cure.costs):
      c = cost_curve.online_costs(self.graphdef, self.params, spec, batch)
      spec = dataclasses.replace(spec, cure=dataclasses.replace(
          spec.cure, cost_draft=c[0], cost_redraft=c[1], cost_verify_base=c[2],
          cost_verify_per_node=c[3]))
    return spec

  def next_spec(self, prompts: list[list[int]]) -> Spec:
    """The Spec the next `generate(prompts)` runs (auto: the target-only program's when no look
    at the drafter falls inside it)."""
    count = len(prompts)
    if self.mesh is not None:   # generate pads the batch to a multiple of mesh.data
      count += -count % sharding.batch_multiple(self.mesh)
    return self.spec(self.cache_len(max(len(p) for p in prompts)), count)

  def _next_look(self, spec: Spec, batch: int) -> int:
    """The step of the first look at the drafter in the next call at `batch`."""
    return self._looks.get(batch, (spec.auto.explore_interval, 0))[1]

  def _last_look(self, spec: Spec) -> int:
    """The last step at which a look can be taken (controller.choose: one the run can repay)."""
    return self.max_new_tokens - spec.auto.explore_interval

  def _learn_looks(self, spec: Spec, batch: int, state) -> None:
    """Keeps what this call at `batch` left for the next: the controller's spacing of looks
    and the iterations to its next look, counted down by a target-only call's iterations."""
    if self.auto is None or batch in self._target_only:
      return
    steps = int(np.max(state.iterations))
    if spec.auto is None:       # target-only this time: the next look draws nearer
      interval, due = self._looks[batch]
      self._looks[batch] = (interval, max(due - steps, 0))
    else:
      ctrl = state.controller
      self._looks[batch] = (int(ctrl.interval), max(int(ctrl.next_look) - int(state.step), 0))

  def cache_len(self, prompt_len: int) -> int:
    """The static cache length for a prompt bucket; checks the user's max_len if given."""
    need = prompt_len + self.max_new_tokens - 1
    if self.max_len is None:  # sized for the bucket, so every prompt in it shares one compile
      return _round_up(prompt_bucket(prompt_len) + self.max_new_tokens - 1, 64)
    if prompt_len > self.max_len:
      raise ValueError(f"a prompt of {prompt_len} tokens is longer than the cache "
                       f"(max_len={self.max_len}): shorten the prompt or raise max_len")
    if need > self.max_len:
      raise ValueError(f"max_new_tokens={self.max_new_tokens} runs past the cache: prompt "
                       f"{prompt_len} + {self.max_new_tokens} new tokens needs max_len >= {need} "
                       f"(got {self.max_len}); raise max_len or lower max_new_tokens")
    return self.max_len

  def check_memory(self, batch: int, max_len: int, prompt_len: int) -> None:
    """Raises ValueError, before anything compiles, when the decode's largest buffers
    (cure_jax/runtime/memory.py, a lower bound) exceed the device's free memory, with the
    largest tree size, batch or cache that could fit."""
    if (batch, max_len) in self._fits:
      return
    nodes = self.cure.v_max if self.cure is not None else self.block_size
    tree = None
    if self.auto is not None:
      tree = (f"{self.method} with auto.budgets up to {nodes}", "node budget in auto.budgets",
              self.block_size)
    elif self.cure is not None:
      tree = (f"{self.method} with cure.v_max={nodes}", "cure.v_max", self.cure.max_depth + 1)
    if self.max_len:
      cache = ("max_len", prompt_len + self.max_new_tokens - 1, max_len, lambda n: n)
    else:
      cache = ("max_new_tokens", 1, self.max_new_tokens,
               lambda n: _round_up(prompt_bucket(prompt_len) + n - 1, 64))
    devices = list(self.mesh.devices.flat) if self.mesh is not None else [jax.devices()[0]]
    memory.check(self.target, self.drafter, method=self.method, batch=batch, max_len=max_len,
                 nodes=nodes, devices=devices, tree=tree, cache=cache)
    self._fits.add((batch, max_len))

  def _executables(self, batch: int, bucket: int, max_len: int, spec: Spec | None = None):
    """Compiled prefill and decode, shared by every Generator with the same model structure."""
    spec = spec or self.spec(max_len, batch)
    key = (self.graphdef, spec, batch, bucket, self.mesh, self.compiler_options)
    platform = (self.mesh.devices.flat[0].platform if self.mesh is not None
                else jax.default_backend())
    options = xla_options.platform_options(platform, dict(self.compiler_options))
    if key not in _EXECUTABLES and self.mesh is not None:
      t0 = time.perf_counter()
      _EXECUTABLES[key] = decoding.compile_sharded(self.graphdef, self.params, spec, batch,
                                                   bucket, self.mesh, options)
      self.compile_s[(batch, bucket, max_len)] = time.perf_counter() - t0
    if key not in _EXECUTABLES:
      t0 = time.perf_counter()
      prompt = jax.ShapeDtypeStruct((batch, bucket), jnp.int32)
      plen = jax.ShapeDtypeStruct((batch,), jnp.int32)
      rng = jax.eval_shape(jax.random.key, 0)
      first = jax.ShapeDtypeStruct((), jnp.int32)
      pre = xla_options.compile_with(decoding.prefill.lower(self.graphdef, self.params, prompt,
                                                         plen, rng, first, spec=spec), options)
      state = jax.eval_shape(lambda p, l, k, f: decoding.prefill(
          self.graphdef, self.params, p, l, k, f, spec=spec), prompt, plen, rng, first)
      dec = xla_options.compile_with(
          decoding.decode.lower(self.graphdef, self.params, state, spec=spec), options)
      _EXECUTABLES[key] = (pre, dec)
      self.compile_s[(batch, bucket, max_len)] = time.perf_counter() - t0
    return _EXECUTABLES[key]

  def compiled_decode(self, batch: int, prompt_len: int):
    """The compiled decode loop `generate` runs for `batch` prompts of up to prompt_len tokens
    (for reading its program: costs/hlo_traffic)."""
    max_len = self.cache_len(prompt_len)
    return self._executables(batch, max_len if self.max_len else prompt_bucket(prompt_len),
                             max_len)[1]

  def generate(self, prompts: list[list[int]], seed: int | None = None,
               first_row: int = 0) -> list[Result]:
    """Decodes one batch of prompts (lists of ids); returns one Result per prompt. Sampling is
    reproducible from `seed` (default: the Generator's): prompt i samples from its own key,
    fold_in(key(seed), first_row + i), whatever else is in the batch."""
    if not prompts:
      raise ValueError("no prompts to decode: the batch is empty")
    if any(len(p) == 0 for p in prompts):
      raise ValueError("every prompt needs at least one token")
    count = len(prompts)
    if self.mesh is not None:  # pad with copies of the last prompt to a multiple of mesh.data
      prompts = list(prompts) + [prompts[-1]] * (-count % sharding.batch_multiple(self.mesh))
    longest = max(len(p) for p in prompts)
    max_len = self.cache_len(longest)
    # with a fixed max_len every prompt pads to it: one compiled prefill for all lengths
    bucket = max_len if self.max_len else prompt_bucket(longest)
    self.check_memory(len(prompts), max_len, longest)
    spec = self.spec(max_len, len(prompts))
    pre, dec = self._executables(len(prompts), bucket, max_len, spec)
    padded = np.zeros((len(prompts), bucket), np.int32)
    for i, p in enumerate(prompts):
      padded[i, :len(p)] = p
    lengths = np.array([len(p) for p in prompts], np.int32)
    put = jnp.asarray if self.mesh is None else lambda x: sharding.put_batch(x, self.mesh)
    key, first = jax.random.key(self.seed if seed is None else seed), np.int32(first_row)
    if self.mesh is not None:
      key, first = sharding.put_key(key, self.mesh), sharding.put_replicated(first, self.mesh)
    state = pre(self.params, put(padded), put(lengths), key, first)
    if spec.auto is not None and len(prompts) in self._looks:   # what earlier calls learned
      scalar = jnp.asarray if self.mesh is None else (
          lambda x: sharding.put_replicated(x, self.mesh))
      interval, due = self._looks[len(prompts)]
      state = state.replace(controller=state.controller.replace(
          interval=scalar(np.int32(interval)), next_look=scalar(np.int32(due))))
    jax.block_until_ready(state)
    t0 = time.perf_counter()
    state = dec(self.params, state)
    state = sharding.to_host(state.replace(cache=None, dcache=None, key=None))  # results only
    decode_s = time.perf_counter() - t0
    self._learn_looks(spec, len(prompts), state)
    return [self._unpack(state, i, decode_s, count) for i in range(count)]

  def _unpack(self, state, i: int, decode_s: float, count: int) -> Result:
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
                  branch0_accepted=int(st.branch0_accepted[i, t]),
                  repair_gain=int(st.repair_gain[i, t]),
                  block_margins=[round(float(m), 4) for m in st.block_margins[i, t]],
                  budget=int(st.budget[i, t]), expected=round(float(st.expected[i, t]), 3))
             for t in range(iters)]
    return Result(output_ids=[int(x) for x in state.tokens[i, :n]], iterations=iters,
                  accept_lengths=[s["accept_lengths"] for s in stats], stats=stats,
                  tpot_ms=1000.0 * decode_s / max(n - 1, 1), decode_s=decode_s,
                  batch_size=count)
