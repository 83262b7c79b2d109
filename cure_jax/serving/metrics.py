"""The server's Prometheus metrics: vLLM's names where vLLM has one, cure_jax's beside them.

Each request ends counted once: completed (vllm:request_success_total, by finish reason),
cancelled (the client left, or the server stopped) or rejected (a 4xx before it ran, or a full
queue), so that completed + cancelled + rejected = requests received.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class Metrics:
  """One registry per server; the scheduler records, /metrics reads."""

  def __init__(self, model: str):
    self.registry = r = CollectorRegistry()
    label = dict(labelnames=["model_name"], registry=r)
    self.running = Gauge("vllm:num_requests_running", "Requests in slots.", **label)
    self.waiting = Gauge("vllm:num_requests_waiting", "Requests queued for a slot.", **label)
    self.ttft = Histogram("vllm:time_to_first_token_seconds", "Time to first token.",
                          buckets=LATENCY_BUCKETS, **label)
    self.itl = Histogram("vllm:inter_token_latency_seconds", "Time between output tokens.",
                         buckets=LATENCY_BUCKETS, **label)
    self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Arrival to last token.",
                         buckets=LATENCY_BUCKETS, **label)
    self.prompt_tokens = Counter("vllm:prompt_tokens", "Prefilled tokens.", **label)
    self.generation_tokens = Counter("vllm:generation_tokens", "Generated tokens.", **label)
    self.success = Counter("vllm:request_success", "Completed requests.",
                           ["model_name", "finished_reason"], registry=r)
    self.drafts = Counter("vllm:spec_decode_num_drafts", "Iterations that verified drafts.",
                          **label)
    self.draft_tokens = Counter("vllm:spec_decode_num_draft_tokens", "Draft nodes verified.",
                                **label)
    self.accepted = Counter("vllm:spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                            **label)
    self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                    "Draft tokens accepted at each position.",
                                    ["model_name", "position"], registry=r)
    self.cancelled = Counter("cure_jax:requests_cancelled", "Requests cancelled (client gone "
                             "or server stopping).", **label)
    self.rejected = Counter("cure_jax:requests_rejected", "Requests refused before running.",
                            ["model_name", "status"], registry=r)
    self.iterations = Counter("cure_jax:iterations", "Decoding iterations over all requests.",
                              **label)
    self.nodes = Counter("cure_jax:nodes_verified", "Tree nodes verified, roots included.",
                         **label)
    self.repair_gain = Counter("cure_jax:repair_gain", "Draft tokens accepted beyond branch 0 "
                               "(CURE's repairs).", **label)
    self.budget = Counter("cure_jax:auto_budget_iterations", "Iterations per node budget the "
                          "auto controller chose.", ["model_name", "budget"], registry=r)
    self.model = model

  def iteration_records(self, accept_lengths, nodes_verified, repair_gain, budgets) -> None:
    """One chunk's records of one request (per iteration)."""
    m = self.model
    self.iterations.labels(m).inc(len(accept_lengths))
    for emitted, nodes, gain, budget in zip(accept_lengths, nodes_verified, repair_gain, budgets):
      self.nodes.labels(m).inc(nodes)
      self.repair_gain.labels(m).inc(gain)
      if budget:
        self.budget.labels(m, str(budget)).inc()
      if nodes > 1:
        self.drafts.labels(m).inc()
        self.draft_tokens.labels(m).inc(nodes - 1)
      self.accepted.labels(m).inc(max(emitted - 1, 0))
      for pos in range(emitted - 1):
        self.accepted_per_pos.labels(m, str(pos)).inc()

  def reject(self, status: int) -> None:
    self.rejected.labels(self.model, str(status)).inc()

  def exposition(self) -> bytes:
    return generate_latest(self.registry)
