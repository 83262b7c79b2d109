"""A request's output as it grows: token ids to text deltas, cut at the first stop string.

Text is decoded from all ids each time (a token's text can depend on the ones before it), and
the tail that could still become a stop string, or is half a UTF-8 character, is held back
until the next tokens settle it.
"""

from __future__ import annotations


class Output:
  def __init__(self, tokenizer, stop: list[str], stop_ids, max_tokens: int):
    self.tokenizer, self.stop, self.stop_ids = tokenizer, stop, stop_ids
    self.max_tokens = max_tokens
    self.ids: list[int] = []
    self.text = ""          # text sent so far
    self.stopped = False    # a stop string ended it

  def _decoded(self) -> str:
    if self.tokenizer is None:
      return ""
    return self.tokenizer.decode(self.ids, skip_special_tokens=True)

  def add(self, ids: list[int]) -> tuple[str, list[int]]:
    """The text and ids to send for new ids (the ids up to a stop string)."""
    before = len(self.ids)
    self.ids += ids
    full = self._decoded()
    cut = min((i for i in (full.find(s) for s in self.stop) if i >= 0), default=-1)
    if cut >= 0:
      self.stopped = True
      return self._send(full[:cut]), self.ids[before:]
    hold = max((len(s) - 1 for s in self.stop), default=0)
    settled = full[:len(full) - hold] if hold else full
    return self._send(settled.rstrip("\ufffd")), self.ids[before:]

  def flush(self) -> str:
    """What was held back, once the request has ended."""
    if self.stopped:
      return ""
    return self._send(self._decoded())

  def _send(self, upto: str) -> str:
    if len(upto) <= len(self.text) or not upto.startswith(self.text):
      return ""
    delta, self.text = upto[len(self.text):], upto
    return delta

  def finish_reason(self) -> str:
    """"stop" (a stop string or token) or "length" (max_tokens reached)."""
    if self.stopped or len(self.ids) < self.max_tokens:
      return "stop"
    return "stop" if self.ids and self.ids[-1] in self.stop_ids else "length"
