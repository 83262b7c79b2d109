"""OpenAI request bodies checked into jobs, and OpenAI's error body for what fails a check.

Every field is read here, before anything runs: a request the server cannot honour as sent
(n > 1, logprobs, a temperature above 0 on a server whose program is greedy) is refused with a
400 naming the field and the fix, never silently served otherwise. A server started sampled
(temperature > 0) takes temperature, top_p and top_k per request, 0 included.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from cure_jax.tree.sampling import Sampling

# fields read as OpenAI defines them; anything else with a value is refused
COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "stream",
          "stream_options", "n", "user", "logprobs", "top_logprobs", "presence_penalty",
          "frequency_penalty"}
COMPLETION = COMMON | {"prompt"}
CHAT = COMMON | {"messages", "max_completion_tokens"}


class ApiError(Exception):
  """An HTTP error with OpenAI's body: {"error": {"message", "type", "param", "code"}}."""

  def __init__(self, status: int, message: str, param: str | None = None,
               code: str | None = None, kind: str = "invalid_request_error",
               headers: dict | None = None):
    super().__init__(message)
    self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind
    self.headers = headers or {}

  def body(self) -> dict:
    return {"error": {"message": self.message, "type": self.kind, "param": self.param,
                      "code": self.code}}


def bad(param: str | None, message: str, code: str = "invalid_value") -> ApiError:
  return ApiError(400, message, param, code)


@dataclasses.dataclass(frozen=True)
class Served:
  """What this server decodes with: checked requests must fit it."""

  model: str
  max_tokens: int
  temperature: float
  top_p: float
  top_k: int
  seed: int
  vocab_size: int
  tokenizer: Any = None

  @property
  def sampled(self) -> bool:
    """Its program samples (per request settings); else it is greedy only."""
    return self.temperature > 0


@dataclasses.dataclass
class Job:
  """One checked request."""

  prompt: list[int]
  max_tokens: int
  seed: int
  sampling: Sampling
  stop: list[str]
  stream: bool
  include_usage: bool
  chat: bool


def _int(body: dict, name: str, default=None, low: int | None = None):
  value = body.get(name, default)
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, int):
    raise bad(name, f"{name} must be an integer, got {value!r}")
  if low is not None and value < low:
    raise bad(name, f"{name}={value} must be >= {low}")
  return value


def _number(body: dict, name: str, default, kind):
  value = body.get(name, default)
  if value is None:
    return kind(default)
  if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
    raise bad(name, f"{name} must be a finite number, got {value!r}")
  if kind is int and value != int(value):
    raise bad(name, f"{name} must be an integer, got {value!r}")
  return kind(value)


def _sampling(body: dict, served: Served) -> Sampling:
  """The request's temperature, top_p and top_k (the server's where left out), checked."""
  s = Sampling(_number(body, "temperature", served.temperature, float),
               _number(body, "top_k", served.top_k, int),
               _number(body, "top_p", served.top_p, float))
  try:
    s.validate()
  except ValueError as e:
    raise bad(str(e).split("=")[0], str(e)) from None
  if not s.greedy and not served.sampled:
    raise bad("temperature", f"temperature={s.temperature} is not served: this server's "
                             "program is greedy (started with temperature 0); send 0 or leave "
                             "it out, or start a server with --config.temperature=1 (it serves "
                             "temperature, top_p and top_k per request, 0 included)",
              "unsupported_value")
  return s


def _refuse_unsupported(body: dict, allowed: set[str]) -> None:
  for name, value in body.items():
    if name not in allowed and value is not None:
      raise bad(name, f"{name} is not supported by this server; leave it out",
                "unsupported_parameter")
  if body.get("n") not in (None, 1):
    raise bad("n", f"n={body['n']!r}: one choice per request is served; send n=1 or leave it "
                   "out", "unsupported_value")
  for name in ("logprobs", "top_logprobs"):
    if body.get(name) not in (None, False, 0):
      raise bad(name, f"{name} is not built into this server; leave it out",
                "unsupported_parameter")
  for name in ("presence_penalty", "frequency_penalty"):
    if body.get(name) not in (None, 0, 0.0):
      raise bad(name, f"{name} is not supported (the decoding is lossless against the "
                      "target's own distribution); send 0 or leave it out",
                "unsupported_value")


def _stop(body: dict) -> list[str]:
  stop = body.get("stop")
  if stop is None:
    return []
  stop = [stop] if isinstance(stop, str) else stop
  if (not isinstance(stop, list) or len(stop) > 4
      or not all(isinstance(s, str) and s for s in stop)):
    raise bad("stop", "stop must be a non-empty string or a list of up to 4 of them")
  return stop


def _ids(prompt, served: Served) -> list[int]:
  """A prompt as token ids: text through the tokenizer, or ids as sent."""
  if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
    prompt = prompt[0]
  if isinstance(prompt, str):
    if served.tokenizer is None:
      raise bad("prompt", "this model has no tokenizer: send the prompt as a list of token ids")
    return list(served.tokenizer.encode(prompt, add_special_tokens=False))
  if (isinstance(prompt, list) and prompt
      and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
    if not all(0 <= t < served.vocab_size for t in prompt):
      raise bad("prompt", f"token ids must lie in [0, {served.vocab_size})")
    return prompt
  raise bad("prompt", "prompt must be one non-empty string or one non-empty list of token ids "
                      "(one prompt per request)")


def _chat_ids(messages, served: Served) -> list[int]:
  if (not isinstance(messages, list) or not messages
      or not all(isinstance(m, dict) and isinstance(m.get("role"), str)
                 and isinstance(m.get("content"), str) for m in messages)):
    raise bad("messages", "messages must be a non-empty list of {\"role\": str, \"content\": "
                          "str}")
  tok = served.tokenizer
  if tok is None or not getattr(tok, "chat_template", None):
    raise bad("messages", "this model has no chat template: use /v1/completions")
  text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
  return list(tok.encode(text, add_special_tokens=False))


def parse(body: Any, served: Served, chat: bool) -> Job:
  """A checked Job from a JSON body of /v1/completions (chat=False) or /v1/chat/completions."""
  if not isinstance(body, dict):
    raise bad(None, "the request body must be a JSON object", "invalid_json")
  _refuse_unsupported(body, CHAT if chat else COMPLETION)
  if "model" not in body:
    raise bad("model", f"model is required: send \"{served.model}\"", "missing_required")
  if body["model"] != served.model:
    raise ApiError(404, f"model {body['model']!r} does not exist: this server serves "
                        f"\"{served.model}\" (GET /v1/models)", "model", "model_not_found")
  name = "max_completion_tokens" if chat and "max_completion_tokens" in body else "max_tokens"
  if body.get(name) is None:
    raise bad(name, f"{name} is required: the most tokens to generate, 1 to "
                    f"{served.max_tokens}", "missing_required")
  max_tokens = _int(body, name, low=1)
  sampling = _sampling(body, served)
  seed = _int(body, "seed", served.seed, low=0)
  stream = body.get("stream", False)
  if not isinstance(stream, bool):
    raise bad("stream", "stream must be true or false")
  options = body.get("stream_options") or {}
  if not isinstance(options, dict) or set(options) - {"include_usage"}:
    raise bad("stream_options", "stream_options takes only {\"include_usage\": bool}")
  if chat:
    prompt = _chat_ids(body.get("messages"), served)
  else:
    if "prompt" not in body:
      raise bad("prompt", "prompt is required", "missing_required")
    prompt = _ids(body["prompt"], served)
  return Job(prompt, max_tokens, seed, sampling, _stop(body), stream,
             bool(options.get("include_usage", False)), chat)
