"""experiments.decode's untimed warm-up: one call, and for auto more until its next call would
run the target-only program (its looks at the drafter settled), never more than WARMUP_CALLS."""

import types

import pytest

from experiments import decode


class _Generator:
  """A stand-in that records its calls; programs: what next_spec says after each call."""

  def __init__(self, auto: bool, programs):
    self.auto = object() if auto else None
    self.programs, self.calls = list(programs), []

  def generate(self, prompts):
    self.calls.append(prompts)
    return []

  def next_spec(self, prompts):
    return types.SimpleNamespace(method=self.programs[len(self.calls) - 1])


@pytest.mark.parametrize("auto, programs, warmups", [
    (False, ["ar"] * 9, 1),                   # not auto: one warm-up call
    (True, ["auto", "ar"] + ["auto"] * 7, 2),   # auto: until the next call is target-only
    (True, ["auto"] * 9, 4),                  # drafting that keeps paying: at most 4
])
def test_warmup_calls(monkeypatch, auto, programs, warmups):
  monkeypatch.setattr(decode.pipeline, "decode_all", lambda gen, ids, batch: gen.calls)
  gen = _Generator(auto, programs)
  config = types.SimpleNamespace(warmup=True)
  assert len(decode._timed(gen, [[1], [2], [3]], config, 2)) == warmups
  assert gen.calls == [[[1], [2]]] * warmups
  assert decode.WARMUP_CALLS == 4
  gen = _Generator(auto, programs)
  decode._timed(gen, [[1]], types.SimpleNamespace(warmup=False), 1)
  assert gen.calls == []
