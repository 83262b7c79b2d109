"""The engine's thread: between chunks it retires ended requests, frees the slots of cancelled
ones, gives waiting ones free slots and a turn of prefill, and hands each request its new
tokens.

Requests live on the server's event loop; the engine runs on this thread (a chunk holds the
GIL only between XLA calls). A request's tokens reach it through its own asyncio queue, so no
request ever reads another's. A full queue refuses at once (429), never later.
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import threading
import time

from cure_jax.serving.engine import Engine, Request, Update
from cure_jax.serving.metrics import Metrics
from cure_jax.serving.requests import ApiError


@dataclasses.dataclass
class Ticket:
  """A request as the scheduler holds it; `events` gets lists of new token ids, then None."""

  request: Request
  loop: asyncio.AbstractEventLoop
  events: asyncio.Queue
  arrived: float
  cancelled: bool = False
  slot: int | None = None
  first_token: float | None = None
  last_token: float | None = None
  iterations: int = 0
  emitted: int = 0              # tokens over those iterations (accepted + bonus)
  finished: bool = False


class Scheduler:
  def __init__(self, engine: Engine, metrics: Metrics, max_waiting: int):
    self.engine, self.metrics, self.max_waiting = engine, metrics, max_waiting
    self.waiting: collections.deque[Ticket] = collections.deque()
    self.owner: dict[int, Ticket] = {}
    self.lock = threading.Condition()
    self.stopping = False
    self.thread = threading.Thread(target=self._run, name="cure_jax-engine", daemon=True)

  def start(self) -> None:
    self.thread.start()

  def submit(self, request: Request) -> Ticket:
    """Queues a request; ApiError 429 when the queue is full, 503 once stopping."""
    with self.lock:
      if self.stopping:
        raise ApiError(503, "the server is shutting down; retry on another replica",
                       code="shutting_down", kind="server_unavailable",
                       headers={"Retry-After": "1"})
      if len(self.waiting) >= self.max_waiting:
        raise ApiError(429, f"the queue is full ({self.max_waiting} requests wait for "
                            f"{self.engine.slots} slots); retry after a second",
                       code="queue_full", kind="rate_limit_exceeded",
                       headers={"Retry-After": "1"})
      ticket = Ticket(request, asyncio.get_running_loop(), asyncio.Queue(), time.perf_counter())
      self.waiting.append(ticket)
      self.metrics.waiting.labels(self.metrics.model).set(len(self.waiting))
      self.lock.notify()
    return ticket

  def cancel(self, ticket: Ticket) -> None:
    """The client is gone: its slot is freed before the next chunk."""
    with self.lock:
      if not ticket.finished:
        ticket.cancelled = True
        self.lock.notify()

  def stop(self, deadline_s: float) -> None:
    """Admits nothing more, lets running requests finish for up to deadline_s, then cancels
    what is left and ends the thread."""
    with self.lock:
      self.stopping = True
      self.lock.notify()
    end = time.perf_counter() + deadline_s
    while time.perf_counter() < end:
      with self.lock:
        if not self.owner and not self.waiting:
          break
      time.sleep(0.05)
    with self.lock:
      for ticket in list(self.owner.values()) + list(self.waiting):
        ticket.cancelled = True
      self.lock.notify()
    self.thread.join(timeout=60)

  # --- the engine thread --------------------------------------------------------------------

  def _run(self) -> None:
    while True:
      with self.lock:
        self._retire_cancelled()
        if not self.owner and not self.waiting:
          if self.stopping:
            return
          self.lock.wait(timeout=0.1)
          continue
      self._admit()
      if self.owner:
        for update in self.engine.step():
          self._deliver(update)

  def _retire_cancelled(self) -> None:
    """Frees cancelled requests' slots (their handlers count them)."""
    for slot, ticket in list(self.owner.items()):
      if ticket.cancelled:
        self.engine.cancel(slot)
        del self.owner[slot]
        self._close(ticket)
    for ticket in [t for t in self.waiting if t.cancelled]:
      self.waiting.remove(ticket)
      self._close(ticket)
    self.metrics.running.labels(self.metrics.model).set(len(self.owner))
    self.metrics.waiting.labels(self.metrics.model).set(len(self.waiting))

  def _admit(self) -> None:
    """Waiting requests into free slots, then one prefill turn outside the lock (so that new
    requests are queued, or refused, meanwhile); a prompt that completes sends its first
    token at once."""
    m = self.metrics
    for slot in self.engine.free_slots():
      with self.lock:
        if not self.waiting:
          break
        ticket = self.waiting.popleft()
        ticket.slot = slot
        self.owner[slot] = ticket
        m.waiting.labels(m.model).set(len(self.waiting))
        m.running.labels(m.model).set(len(self.owner))
      self.engine.begin(slot, ticket.request)
      m.prompt_tokens.labels(m.model).inc(len(ticket.request.prompt))
    for update in self.engine.fill():
      self._deliver(update)

  def _deliver(self, u: Update) -> None:
    m = self.metrics
    with self.lock:
      ticket = self.owner.get(u.slot)
      if ticket is None:
        return
      now = time.perf_counter()
      if u.tokens:  # tokens of one chunk arrive together: the gap since the last is shared
        if ticket.first_token is None:
          ticket.first_token = ticket.last_token = now
          m.ttft.labels(m.model).observe(now - ticket.arrived)
        for _ in range(len(u.tokens) - (ticket.first_token == now)):
          m.itl.labels(m.model).observe((now - ticket.last_token) / len(u.tokens))
        ticket.last_token = now
        m.generation_tokens.labels(m.model).inc(len(u.tokens))
      ticket.iterations += len(u.accept_lengths)
      ticket.emitted += sum(u.accept_lengths)
      m.iteration_records(u.accept_lengths, u.nodes_verified, u.repair_gain, u.budgets)
      ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, u.tokens)
      if u.finished:
        del self.owner[u.slot]
        m.running.labels(m.model).set(len(self.owner))
        ticket.finished = True
        m.e2e.labels(m.model).observe(now - ticket.arrived)
        ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, None)

  def _close(self, ticket: Ticket) -> None:
    ticket.finished = True
    ticket.loop.call_soon_threadsafe(ticket.events.put_nowait, None)
