"""The serving engine against offline decoding: a request's tokens equal `Generator.generate`
decoding it alone at batch 1 (a different code path: the prompt's own prefill and decode
loop, no slots), whatever slot it takes, whoever shares its chunks and whenever it arrives.
Random models in numerics=invariant, so equality is bitwise for greedy and seeded sampling."""

import gc

import jax
import numpy as np
import pytest

from cure_jax.analysis import random_models
from cure_jax.runtime import generation
from cure_jax.runtime.generation import Generator
from cure_jax.serving.engine import Engine, Request
from cure_jax.tree.sampling import Sampling

ARCH = random_models.Arch(vocab=8, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                          draft_layers=1, block_size=4, target_layer_ids=(0, 1))
MAX_LEN, MAX_NEW = 48, 12
CURE = dict(tau_margin=1e9, v_max=16, topk=2, beam_width=3)  # a repair every block


@pytest.fixture(autouse=True)
def _release_each_tests_programs():
  """Each test here builds engines of a dozen or more programs and compiles offline references;
  they are dropped after every test, not only at the module's end (conftest), so that the
  module stays under vm.max_map_count, past which XLA:CPU crashes in its next compile."""
  yield
  generation.release_compiled()
  jax.clear_caches()
  gc.collect()


@pytest.fixture(scope="module")
def models():
  target, drafter = random_models.pair(ARCH, 4)
  target.numerics = "invariant"
  small = random_models.ar_drafter(ARCH, 4)
  return target, drafter, small


def _generator(models, method, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, mesh=None):
  from cure_jax.tree import controller, repair
  target, drafter, small = models
  kinds = {"ar": None, "ar_draft": small}
  block = 3 if method == "ar_draft" else None
  cure = repair.RepairConfig(max_depth=ARCH.block_size - 1, **CURE)
  auto = controller.Settings(budgets=(1, 12), costs=(1.0, 1.05), explore_every=3)
  return Generator(target, kinds.get(method, drafter), method=method,
                   max_new_tokens=max_new_tokens, max_len=MAX_LEN, block_size=block,
                   cure=cure if method in ("cure", "hybrid", "ddtree") else None,
                   sampling=Sampling(temperature, top_k, top_p),
                   auto=auto if method == "auto" else None, mesh=mesh)


def _requests(count, seed=9):
  prompts = random_models.prompts(seed, ARCH.vocab, count, lo=3, hi=20)
  rng = np.random.default_rng(seed)
  return [Request(tuple(p), int(rng.choice([5, MAX_NEW])), int(rng.integers(1000)))
          for p in prompts]


def _alone(models, method, requests, temperature=0.0):
  """Each request decoded by itself offline, its max_tokens as max_new_tokens."""
  gens = {}
  out = []
  for r in requests:
    if r.max_tokens not in gens:
      gens[r.max_tokens] = _generator(models, method, r.max_tokens, temperature)
    out.append(gens[r.max_tokens].generate([list(r.prompt)], seed=r.seed)[0].output_ids)
  return out


def _serve(engine, requests, arrivals, schedule=None):
  """Runs the engine until every request is done; request i is queued before chunk
  arrivals[i] and enters the first free slot. Returns each request's tokens and slot;
  `schedule` gets (live requests, rows of the state) for each chunk."""
  tokens = [[] for _ in requests]
  slot_of, owner = {}, {}
  waiting = []
  chunk = 0
  while len(slot_of) < len(requests) or owner:
    waiting += [i for i, a in enumerate(arrivals) if a == chunk]
    for slot in engine.free_slots():
      if waiting:
        i = waiting.pop(0)
        tokens[i] = [engine.insert(slot, requests[i])]
        slot_of[i], owner[slot] = slot, i
    live = len(owner)
    for u in engine.step():
      tokens[owner[u.slot]] += u.tokens
      if u.finished:
        del owner[u.slot]
    if schedule is not None:
      schedule.append((live, engine.rows))
    chunk += 1
    assert chunk < 200
  return tokens, slot_of


METHODS = ["ar", "chain", "ddtree", "cure", "hybrid", "auto", "ar_draft"]


@pytest.mark.parametrize("method", METHODS)
def test_every_method_served_equals_each_request_decoded_alone(models, method):
  """Seven greedy requests through 3 slots, arriving at chunks 0, 0, 0, 1, 2, 2, 5 (so some
  are inserted beside running ones and slots are reused)."""
  requests = _requests(7)
  engine = Engine(_generator(models, method, MAX_NEW), slots=3, max_len=MAX_LEN, steps=2)
  got, slots = _serve(engine, requests, [0, 0, 0, 1, 2, 2, 5])
  assert got == _alone(models, method, requests)
  assert len(set(slots.values())) == 3 and engine.free_slots() == [0, 1, 2]


@pytest.mark.parametrize("method", ["ar", "chain", "ddtree", "cure"])
def test_seeded_sampling_served_equals_each_request_decoded_alone(models, method):
  """Temperature 1: a request samples from its own seed, not from its slot; the draws are
  real (requests with other seeds and the same prompt emit other tokens)."""
  requests = _requests(6, seed=3)
  engine = Engine(_generator(models, method, MAX_NEW, 1.0), slots=2, max_len=MAX_LEN, steps=3)
  got, _ = _serve(engine, requests, [0, 1, 1, 1, 3, 4])
  assert got == _alone(models, method, requests, 1.0)
  reseeded = [Request(r.prompt, r.max_tokens, r.seed + 1) for r in requests]
  again, _ = _serve(engine, reseeded, [0] * len(reseeded))
  assert sum(a != g for a, g in zip(again, got)) >= 3


# (temperature, top_k, top_p) per request: greedy rows beside sampled ones of other settings
SETTINGS = [(0.0, 0, 1.0), (1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.5, 2, 0.9),
            (0.0, 0, 1.0), (1.0, 4, 0.7)]


@pytest.mark.parametrize("method", ["ar", "chain", "ddtree", "cure"])
def test_per_request_settings_served_equal_each_request_decoded_alone(models, method):
  """One sampled engine, seven requests each with its own temperature, top-k and top-p
  (greedy ones among them) sharing chunks: each request's tokens equal it decoded alone by a
  Generator compiled with its settings (the greedy program for temperature 0)."""
  requests = [Request(r.prompt, r.max_tokens, r.seed, Sampling(*s))
              for r, s in zip(_requests(7, seed=11), SETTINGS)]
  engine = Engine(_generator(models, method, MAX_NEW, 1.0), slots=3, max_len=MAX_LEN, steps=2)
  got, _ = _serve(engine, requests, [0, 0, 0, 1, 1, 2, 3])
  alone = [_generator(models, method, r.max_tokens, r.sampling.temperature, r.sampling.top_k,
                      r.sampling.top_p).generate([list(r.prompt)], seed=r.seed)[0].output_ids
           for r in requests]
  assert got == alone
  greedy = _alone(models, method, requests)   # the sampled rows do not all decode greedily
  assert sum(g != a for g, a, s in zip(greedy, alone, SETTINGS) if s[0]) >= 2


def test_a_greedy_engine_refuses_a_sampled_request(models):
  engine = Engine(_generator(models, "chain", MAX_NEW), slots=1, max_len=MAX_LEN)
  with pytest.raises(ValueError, match="temperature > 0"):
    engine.insert(0, Request((1, 2, 3), 4, 0, Sampling(0.7)))
  with pytest.raises(ValueError, match="top_p=0"):
    engine.insert(0, Request((1, 2, 3), 4, 0, Sampling(0.0, 0, 0.0)))
  assert engine.free_slots() == [0]


def test_cancel_frees_the_slot_for_the_next_request(models):
  """A cancelled request's slot takes the next request at once; that request's tokens are
  its own (nothing left over from the cancelled one)."""
  engine = Engine(_generator(models, "chain", MAX_NEW), slots=1, max_len=MAX_LEN, steps=1)
  first, second = _requests(2, seed=5)
  engine.insert(0, Request(first.prompt, MAX_NEW, first.seed))
  assert engine.free_slots() == [] and len(engine.step()[0].tokens) >= 1
  engine.cancel(0)
  assert engine.free_slots() == [0] and engine.step() == []
  got, _ = _serve(engine, [second], [0])
  assert got == _alone(models, "chain", [second])


def test_bad_requests_are_refused_before_they_run(models):
  engine = Engine(_generator(models, "ar", MAX_NEW), slots=1, max_len=MAX_LEN)
  with pytest.raises(ValueError, match="max_len=48"):
    engine.insert(0, Request(tuple(range(7)) * 6, MAX_NEW))
  with pytest.raises(ValueError, match="max_tokens=13 is over"):
    engine.check(3, MAX_NEW + 1)
  with pytest.raises(ValueError, match="empty"):
    engine.check(0, 3)
  assert engine.free_slots() == [0]
  with pytest.raises(ValueError, match="prefill_chunk=0"):
    Engine(_generator(models, "ar", MAX_NEW), slots=1, max_len=MAX_LEN, prefill_chunk=0)


def _bucket(live: int, slots: int) -> int:
  """The rule: the smallest of 1, 2, 4, ... (then slots) that holds the live requests."""
  rows = 1
  while rows < live:
    rows *= 2
  return min(rows, slots)


def test_the_chunk_computes_the_rows_the_live_requests_need(models):
  """8 slots: a lone request runs the one-row program, and each chunk's rows are the
  smallest bucket holding the live requests as they come and go (rows are moved when the
  state shrinks); every request still equals decoding it alone."""
  requests = _requests(8, seed=11)
  engine = Engine(_generator(models, "chain", MAX_NEW), slots=8, max_len=MAX_LEN, steps=2)
  schedule = []
  got, _ = _serve(engine, requests, [0, 2, 2, 3, 3, 3, 3, 12], schedule)
  assert schedule[0] == (1, 1) and schedule[-1] == (1, 1)
  assert [rows for _, rows in schedule] == [_bucket(live, 8) for live, _ in schedule]
  assert {rows for _, rows in schedule} >= {1, 2, 8}
  assert got == _alone(models, "chain", requests)


def test_a_long_prompt_is_prefilled_between_decode_chunks(models):
  """Prefill steps of 4 tokens, turns of 8: a 19-token prompt arriving beside a running
  request is prefilled 8, 16, then 19 tokens, one turn before each chunk, and the running
  request gets new tokens from every chunk meanwhile; both equal decoding alone."""
  short, long = _requests(2, seed=13)
  long = Request(tuple(random_models.prompts(1, ARCH.vocab, 1, lo=19, hi=19)[0]), MAX_NEW, 4)
  short = Request(short.prompt, MAX_NEW, short.seed)
  assert len(long.prompt) == 19
  engine = Engine(_generator(models, "ar", MAX_NEW), slots=2, max_len=MAX_LEN, steps=1,
                  prefill_chunk=4, prefill_turn=8)
  tokens = {0: [engine.insert(0, short)]}
  engine.begin(1, long)
  prefilled, running = [], []
  while engine.live.any() or engine.filling:
    for u in engine.fill():
      tokens[u.slot] = u.tokens
    if len(prefilled) < 3:
      prefilled.append(engine.filling[1].prefilled if engine.filling else len(long.prompt))
    for u in engine.step():
      tokens[u.slot] += u.tokens
    running.append(len(tokens[0]))
  assert prefilled == [8, 16, 19]
  assert running[0] < running[1] < running[2]
  assert [tokens[0], tokens[1]] == _alone(models, "ar", [short, long])


def test_requests_coming_and_going_compile_nothing_more(models):
  """After the engine is built, nine requests of other lengths and limits, inserted while
  others run and cancelled midway, trigger no compilation."""
  engine = Engine(_generator(models, "cure", MAX_NEW), slots=2, max_len=MAX_LEN, steps=2)
  compiles = []
  listen = lambda event, *_, **__: compiles.append(event) if "backend_compile" in event else None
  jax.monitoring.register_event_duration_secs_listener(listen)
  try:
    requests = _requests(9, seed=7)
    engine.insert(1, requests[0])
    engine.step()
    engine.cancel(1)
    _serve(engine, requests[1:], [0, 0, 1, 1, 2, 3, 3, 6])
  finally:
    jax.monitoring.unregister_event_duration_listener(listen)
  assert compiles == []


def test_paced_chunks_run_the_iterations_that_fit_and_change_no_token(models, monkeypatch):
  """chunk_s 0.3 s on a clock where every chunk takes 0.125 s (binary fractions: exact): the
  first chunk of a row count runs 1 iteration (its pace: 0.125 s each), then 2 (0.3 // 0.125),
  then 4 (0.0625 s each), then what is left (at most `steps`); the tokens are those of
  decoding alone whatever the chunks' lengths."""
  from cure_jax.serving import engine as engine_module
  clock = iter(np.arange(0.0, 100.0, 0.125))   # read before and after a chunk
  monkeypatch.setattr(engine_module, "time", type("Clock", (), {
      "perf_counter": staticmethod(lambda: float(next(clock)))}))
  request = Request(_requests(1, seed=21)[0].prompt, MAX_NEW, 3)
  engine = Engine(_generator(models, "ar", MAX_NEW), slots=1, max_len=MAX_LEN, steps=6,
                  chunk_s=0.3)
  tokens, ran = [engine.insert(0, request)], []
  while engine.live.any():
    for u in engine.step():
      tokens += u.tokens
    ran.append(int(engine.state.step))
  assert ran == [1, 2, 4, MAX_NEW - 1 - 7]   # 11 tokens after the first: 1 + 2 + 4 + 4
  assert tokens == _alone(models, "ar", [request])[0]
  with pytest.raises(ValueError, match="chunk_s=0"):
    Engine(_generator(models, "ar", MAX_NEW), slots=1, max_len=MAX_LEN, chunk_s=0)
