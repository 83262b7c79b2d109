"""Prompts for drafter training data, built from packages, never from an evaluation set.

Sources: HumanEval 64-163 in four framings (0-63 are the evaluation problems of every table),
HumanEval-style stubs from standard-library signatures and docstrings and instructions derived
from them, synthetic coding tasks, explanation questions, and arithmetic word problems from
templates. The held-out maths set comes from templates the training prompts never use, with
other names and numbers: a drafter is judged on problems it never saw.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import random
import sys
import textwrap
import warnings

from cure_jax.runtime import prompts as prompts_lib

EVAL_HUMANEVAL = 64  # HumanEval problems 0..63 are evaluation problems: never trained on

_SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test",
                 "lib2to3", "ensurepip", "pydoc_data", "webbrowser", "pty", "tty", "curses",
                 "msvcrt", "winreg", "winsound", "nt", "_winapi", "xxsubtype", "sre_compile",
                 "sre_parse", "sre_constants", "asyncio", "multiprocessing", "concurrent", "venv",
                 "distutils", "smtpd", "asynchat", "asyncore", "imp", "crypt", "nis", "spwd",
                 "ossaudiodev", "readline", "rlcompleter", "site", "cgitb", "trace", "pdb"}


def stdlib_functions() -> list[tuple[str, str, str, str]]:
  """(module, qualified name, signature, docstring) of documented pure-Python stdlib callables."""
  out = []
  warnings.simplefilter("ignore")
  for m in sorted(sys.stdlib_module_names):
    if m.startswith("_") or m in _SKIP_MODULES:
      continue
    try:
      mod = importlib.import_module(m)
    except Exception:  # platform-specific modules
      continue
    items = []
    for name, obj in sorted(vars(mod).items()):
      if name.startswith("_"):
        continue
      if inspect.isfunction(obj) and obj.__module__ == m:
        items.append((name, obj))
      elif inspect.isclass(obj) and getattr(obj, "__module__", None) == m:
        items.extend((f"{name}.{k}", v) for k, v in sorted(vars(obj).items())
                     if not k.startswith("_") and inspect.isfunction(v))
    for name, fn in items:
      doc = inspect.getdoc(fn)
      if not doc or len(doc) < 40:
        continue
      try:
        sig = str(inspect.signature(fn))
      except (TypeError, ValueError):
        continue
      out.append((m, name, sig, doc))
  return out


def _short_doc(doc: str, max_lines: int = 12) -> str:
  lines = [l.rstrip() for l in doc.strip().splitlines()]
  return "\n".join(lines[:max_lines]).replace('"""', "'''")


def _stub(name: str, sig: str, doc: str) -> str:
  """A HumanEval-style stub: signature and docstring, no body."""
  fname = name.split(".")[-1]
  if "." in name and sig.startswith("(self"):
    sig = "(" + sig[len("(self"):].lstrip(", ")
  body = textwrap.indent('"""' + _short_doc(doc) + '\n"""\n', "    ")
  return f"def {fname}{sig}:\n{body}"


_INSTRUCTIONS = [
    "Write a Python function `{f}{sig}` that does the following:\n{doc}",
    "Implement `{f}` in Python.\n\n{doc}",
    "Explain what the Python function `{m}.{name}` does and give a short example.",
    "Write a Python function called {f} that {first}",
]
_TOPICS = ["a list", "a string", "a dictionary", "a binary tree", "a linked list", "a matrix",
           "a set of intervals", "a text file", "a CSV file", "a JSON object", "a graph",
           "a sorted array", "a queue", "a stack", "a date", "a URL", "an integer", "a sentence"]
_TASKS = ["reverse {t}", "count the elements of {t}", "find the largest value in {t}",
          "remove duplicates from {t}", "check whether {t} is valid", "sort {t}",
          "print {t} nicely", "compute a checksum of {t}", "merge two of {t}",
          "find the second smallest item in {t}", "serialize {t}", "validate {t}",
          "split {t} into chunks of size k", "flatten {t}", "search {t} for a target value"]
_TASK_TEMPLATES = ["Write a Python function to {task}.", "How do I {task} in Python?",
                   "Write a Python class to {task}, with docstrings.",
                   "Write a function that takes {t2} and returns it after you {task}.",
                   "Give a short Python example that shows how to {task}."]
_CONCEPTS = ["recursion", "a hash table", "binary search", "dynamic programming", "big-O notation",
             "a closure", "a generator", "list comprehensions", "decorators", "exceptions",
             "the GIL", "unit testing", "a REST API", "git branches", "a prime number",
             "the Fibonacci sequence", "photosynthesis", "gravity", "inflation", "a neural network",
             "the water cycle", "a black hole", "DNA", "compound interest", "an algorithm",
             "object-oriented programming", "a database index", "TCP vs UDP", "sorting algorithms",
             "the quicksort algorithm", "merge sort", "a palindrome", "regular expressions"]

# Arithmetic word problems. The last _HELDOUT_TEMPLATES are only ever in the held-out set.
_NAMES = ["Ava", "Ben", "Chen", "Dana", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jade", "Kofi",
          "Lena", "Mateo", "Nia", "Omar", "Priya", "Quinn", "Rosa", "Sam", "Tariq", "Uma", "Viktor",
          "Wen", "Yara", "Zoe"]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "books", "cookies", "stamps", "tickets",
          "shells", "cards", "bottles", "flowers", "eggs", "coins", "balloons", "bricks"]
_WORD_PROBLEMS = [
    "{n1} has {a} {item}. {n2} gives {n1} {b} more. How many {item} does {n1} have now?",
    "{n1} had {a} {item} and gave away {c}. How many {item} are left?",
    "A box holds {c} {item}. How many {item} are in {b} boxes?",
    "{n1} shares {prod} {item} equally among {c} friends. How many does each friend get?",
    "{n1} buys {b} {item} at ${c} each and pays with ${big}. How much change does {n1} get?",
    "A shop sells {item} in packs of {c}. {n1} needs {a} {item}. How many packs must {n1} buy?",
    "{n1} reads {c} pages a day. How many days to finish a {prod}-page book?",
    "A train leaves at {h}:00 and travels for {c} hours. At what time does it arrive "
    "(24-hour clock)?",
    "{n1} saves ${c} every week. How much has {n1} saved after {b} weeks?",
    "There are {a} students and each bus holds {c}. How many buses are needed?",
    "{n1} has {a} {item}, {n2} has {b} more than {n1}. How many do they have together?",
    "A rectangle is {a} m long and {c} m wide. What are its area and perimeter?",
    "{n1} runs {c} km on Monday and {b} km on Tuesday. How far did {n1} run in total?",
    "A recipe needs {c} eggs for {b} cakes. How many eggs for {a} cakes? Explain.",
    "{n1} is {c} years old. {n2} is {b} years older. How old will {n2} be in {a} years?",
    "A tank holds {big} litres and leaks {c} litres an hour. How long until it is empty?",
    "{n1} scored {a}, {b} and {c} points in three games. What is the average score?",
    "{prod} {item} are packed {c} to a bag. How many bags, and how many {item} are left over "
    "if there are {a} more {item}?",
    # held out:
    "{n1} earns ${c} an hour and works {b} hours. {n1} spends ${a} of it. How much is left?",
    "A garden has {b} rows of {c} plants, and {few} plants died. How many plants are alive?",
    "{n1} walks {c} km per hour. How many km does {n1} walk in {b} hours and a half?",
    "Tickets cost ${c} for adults and ${b} for children. What do {a} adults and {c} children pay?",
    "{n1} cuts a {prod} cm ribbon into pieces of {c} cm. How many pieces are there?",
    "A number doubled and then increased by {b} gives {dbl}. What is the number? Show the steps.",
]
_HELDOUT_TEMPLATES = 6


def word_problem(rng: random.Random, template: str) -> str:
  """One problem of `template` with random names, item and numbers."""
  a, b, c = rng.randint(5, 99), rng.randint(2, 12), rng.randint(2, 15)
  n1, n2 = rng.sample(_NAMES, 2)
  return template.format(n1=n1, n2=n2, a=a, b=b, c=c, prod=b * c * rng.randint(1, 4),
                         big=b * c + rng.randint(1, 50), h=rng.randint(5, 12),
                         dbl=2 * a + b, few=rng.randint(1, b * c - 1), item=rng.choice(_ITEMS))


def maths_prompts(rng: random.Random, n: int, heldout: bool) -> list[str]:
  """n distinct word problems from the training or the held-out templates."""
  split = len(_WORD_PROBLEMS) - _HELDOUT_TEMPLATES
  templates = _WORD_PROBLEMS[split:] if heldout else _WORD_PROBLEMS[:split]
  out: dict[str, None] = {}
  while len(out) < n:
    out[word_problem(rng, rng.choice(templates))] = None
  return list(out)


def training_prompts(seed: int, maths: int) -> list[dict]:
  """Every training prompt row {prompt, src}, shuffled (deterministic for a seed)."""
  rng = random.Random(seed)
  rows = []
  for p in prompts_lib.humaneval_prompts()[EVAL_HUMANEVAL:]:
    code = p["prompt"]
    rows += [dict(prompt=code, src="he"),
             dict(prompt=f"Complete the following Python function:\n\n```python\n{code}```",
                  src="he_complete"),
             dict(prompt=f"Explain what this code should do, then implement it:\n\n{code}",
                  src="he_explain"),
             dict(prompt=f"Write unit tests for this function:\n\n{code}", src="he_tests")]
  for m, name, sig, doc in stdlib_functions():
    rows.append(dict(prompt=(f"import {m}\n\n\n" if rng.random() < 0.3 else "") +
                     _stub(name, sig, doc), src="stub"))
    first = doc.strip().splitlines()[0].rstrip(".")
    first = first[0].lower() + first[1:] if first else first
    rows.append(dict(prompt=rng.choice(_INSTRUCTIONS).format(
        f=name.split(".")[-1], sig=sig, doc=_short_doc(doc, 6), m=m, name=name, first=first),
        src="instr"))
  for t, task, tmpl in itertools.product(_TOPICS, _TASKS, _TASK_TEMPLATES):
    rows.append(dict(prompt=tmpl.format(task=task.format(t=t), t2=rng.choice(_TOPICS)),
                     src="task"))
  for c in _CONCEPTS:
    rows += [dict(prompt=tmpl.format(c=c), src="explain") for tmpl in
             ("Explain {c} in simple terms.", "What is {c}? Give an example.",
              "Write a short paragraph about {c}.")]
  rows += [dict(prompt=p, src="maths") for p in maths_prompts(rng, maths, heldout=False)]
  rng.shuffle(rows)
  return rows


def heldout_maths(seed: int, n: int) -> list[dict]:
  """n held-out maths word problems {prompt, src}, from the templates training never uses."""
  held = maths_prompts(random.Random(seed + 1000), n, heldout=True)
  return [dict(prompt=p, src="maths_heldout") for p in held]
