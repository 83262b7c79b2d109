"""experiments.decode's summary line: tokens per second are the whole batch's output over the
time the batches took, not one sequence's."""

from cure_jax.runtime import pipeline
from cure_jax.runtime.generation import Result


def _result(tokens: int, decode_s: float, batch_size: int) -> Result:
  return Result(output_ids=list(range(tokens)), iterations=tokens - 1,
                accept_lengths=[1] * (tokens - 1), stats=[], tpot_ms=0.0, decode_s=decode_s,
                batch_size=batch_size)


def test_tokens_per_second_count_each_batch_time_once():
  """A batch of 8 sequences of 21 tokens in 2 s makes 8 x 20 / 2 = 80 tokens/s (each result
  carries the batch's 2 s); then a batch of 2 of 11 tokens in 1 s: (160 + 20) / 3 s = 60."""
  batch = [_result(21, 2.0, 8) for _ in range(8)]
  assert pipeline.summary(batch)["tokens_per_s"] == 80.0
  assert pipeline.summary(batch + [_result(11, 1.0, 2)] * 2)["tokens_per_s"] == 60.0
