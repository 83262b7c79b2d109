"""numerics="invariant" (cure_jax/models/numerics.py): a token's logits are bitwise the same
whatever else is computed with them. Each invariance is also shown failing in the default mode on
the same inputs, so that the tests can fail: the default mode is what they guard against."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from configs import common
from cure_jax.analysis import random_models
from cure_jax.models import layers, numerics
from cure_jax.models.qwen3 import Qwen3
from cure_jax.models.kernels import gpu_exact_attention, gpu_rows, tpu_exact_attention
from cure_jax.models.kernels import prefix as prefix_attention
from cure_jax.runtime import pipeline
from tests.test_attention_kernels import _inputs, reference

ROWS = [1, 2, 3, 8, 16, 17, 32, 33, 64, 100]
# the embedded default's (SmolLM2-135M) products as (K, N): q/o, k/v, gate/up, down and the tied
# head, each a weight held as rows [N, K] times x [M, K]
PRODUCTS = [(576, 576), (576, 192), (576, 1536), (1536, 576), (576, 49152)]
# the invariant attention's three forms: XLA's elementwise tensors (CPU) and the GPU and TPU
# kernels, run here in Pallas interpret mode
ATTENDS = {"elementwise": numerics._elementwise_attend,
           "gpu": functools.partial(gpu_exact_attention.attend, interpret=True),
           "tpu": functools.partial(tpu_exact_attention.attend, interpret=True)}


def _rows_alone_vs_together(product, k, n, seed):
  """Per M in ROWS, whether every row of product(x[:M], w [N, K]) equals that row computed
  alone."""
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((max(ROWS), k)).astype(np.float32)
  w = jnp.asarray(rng.standard_normal((n, k)).astype(np.float32))
  f = jax.jit(product)
  alone = np.concatenate([np.asarray(f(jnp.asarray(x[i:i + 1]), w)) for i in range(max(ROWS))])
  return [np.array_equal(np.asarray(f(jnp.asarray(x[:m]), w)), alone[:m]) for m in ROWS]


@pytest.mark.parametrize("k,n", PRODUCTS)
def test_matmul_rows_do_not_depend_on_the_rows_beside_them(k, n):
  """XLA:CPU multiplies one row through a GEMV and 2-16 rows weight-first through one GEMM
  kernel (32 take another): the plain product's rows change with M; the invariant tiles' do
  not."""
  assert all(_rows_alone_vs_together(numerics.matmul, k, n, 0))
  assert not all(_rows_alone_vs_together(lambda x, w: x @ w.T, k, n, 0))


@pytest.mark.parametrize("m,k,n", [(1, 64, 48), (17, 96, 64), (40, 256, 128)])
def test_gpu_kernel_tiles_give_the_product_with_rows_alone(m, k, n):
  """gpu_rows' kernel in Pallas interpret mode: the product of float32 inputs to within float32
  sums of K terms (|error| <= K * 2^-24 * sum |x||w| per entry), and each row bitwise what it is
  computed alone: tiles of fixed size, whatever M (K and N take 3 tile sizes between them);
  asked for bfloat16, the float32 sums rounded once."""
  rng = np.random.default_rng(m)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = rng.standard_normal((n, k)).astype(np.float32)
  f = jax.jit(lambda a, b: gpu_rows.product(a, b, interpret=True))
  got = np.asarray(f(jnp.asarray(x), jnp.asarray(w)))
  bound = k * 2.0 ** -24 * (np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T)
  assert (np.abs(got - x.astype(np.float64) @ w.astype(np.float64).T) <= bound).all()
  for i in (0, m - 1):
    np.testing.assert_array_equal(np.asarray(f(jnp.asarray(x[i:i + 1]), jnp.asarray(w)))[0],
                                  got[i])
  halves = gpu_rows.product(jnp.asarray(x), jnp.asarray(w), dtype=jnp.bfloat16, interpret=True)
  np.testing.assert_array_equal(np.asarray(halves), np.asarray(jnp.asarray(got, jnp.bfloat16)))


def test_invariant_mode_holds_every_kernel_as_rows_and_gives_them_back():
  """Entering numerics=invariant holds each projection (and an untied head) as [out, in] rows,
  the transposed kernel; leaving it restores the kernels bitwise. A mixture-of-experts target
  is refused: its expert products are not row-invariant."""
  target, _ = random_models.pair(random_models.Arch(tie=False), 0)
  before = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(target))}
  target.numerics = "invariant"
  linears = [m for _, m in nnx.iter_modules(target) if isinstance(m, layers.Linear)]
  assert len(linears) == 7 * target.cfg.num_layers + 1                  # + the untied head
  held = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(target))}
  assert not any(path[-1] == "kernel" for path in held)
  for path, rows in held.items():
    if path[-1] == "kernel_rows":
      np.testing.assert_array_equal(rows, before[path[:-1] + ("kernel",)].T)
  np.testing.assert_array_equal(target.head_weight(), before[("lm_head", "kernel")].T)
  target.numerics = "default"
  after = {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(target))}
  assert after.keys() == before.keys()
  for path, value in before.items():
    np.testing.assert_array_equal(after[path], value)
  abstract = nnx.eval_shape(lambda: Qwen3(target.cfg))        # as experiments.aot builds it
  abstract.numerics = "invariant"
  q_rows = abstract.layers[0].self_attn.q_proj.kernel_rows.get_value()
  assert q_rows.shape == before[("layers", 0, "self_attn", "q_proj", "kernel")].shape[::-1]
  moe, _ = random_models.pair(random_models.Arch(experts=4, top_k=2), 0)
  with pytest.raises(ValueError, match="mixture of experts"):
    moe.numerics = "invariant"


def test_norm_rows_do_not_depend_on_the_rows_beside_them():
  """XLA:CPU vectorises a row-wise mean across rows from 8 rows on; the explicit tree of adds
  gives each row the same sum at any count."""
  norm = layers.RMSNorm(576, 1e-6, jnp.float32)
  x = np.random.default_rng(1).standard_normal((64, 576)).astype(np.float32) * 3

  def rows(mode):
    with numerics.mode(mode):
      f = jax.jit(lambda v: norm(v))
      alone = np.concatenate([np.asarray(f(jnp.asarray(x[i:i + 1]))) for i in range(64)])
      return [np.array_equal(np.asarray(f(jnp.asarray(x[:m]))), alone[:m]) for m in (2, 8, 64)]

  assert all(rows("invariant"))
  assert not all(rows("default"))


def _exponents(v_old, v_new, slack: int):
  """[KVH, D] exponents 2^slack above the largest |value| of each column, cache and new tokens
  alike (value_exponents' bound is loose by about the hidden size: 2^12 for Qwen3-8B)."""
  top = np.maximum(np.abs(v_old).max(axis=(0, 2)), np.abs(v_new).max(axis=(0, 1, 2)))
  return jnp.asarray(np.frexp(top)[1] + slack, jnp.int32)


@pytest.mark.parametrize("form", ATTENDS)
@pytest.mark.parametrize("shape", [(2, 1, 1, 4, 2, 64, 256, 1), (2, 1, 17, 8, 2, 64, 384, 17),
                                   (1, 1, 16, 8, 4, 128, 128, 16)])
def test_attention_equals_softmax_attention(shape, form):
  """Against float64 attention, the values' bound 2^12 above their largest: each cut to the grid
  costs under 2^(12 - 44) of the largest value, at most S + U of them over a denominator of at
  least 1 (384 keys: 2^-23.4), below float32's own rounding (scores, exp and the division: a
  few ulp of the output's scale)."""
  args = _inputs(shape, seed=sum(shape))
  want = reference(*(np.asarray(x, np.float64) if x.dtype != bool else
                     np.broadcast_to(x, args[0].shape[:3] + x.shape[-1:]) for x in args))
  got = np.asarray(jax.jit(ATTENDS[form])(*map(jnp.asarray, args),
                                          _exponents(args[2], args[4], 12)))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)


def test_int32_limb_sums_are_exact_whatever_the_split():
  """The TPU form of the exact sums (int32 limbs, blocks of 512 terms): 256 sums of trunc(x 2^s)
  over 1,300 terms of both signs and many sizes, against Python's integers, to within the
  limbs' fixed roundings (3 of float32's); and bitwise the same split in two parts at several
  places, and with the terms permuted (digits left uncarried round differently in some of the
  256). The int64 form rounds the same integer once."""
  rng = np.random.default_rng(4)
  x = (rng.standard_normal((256, 1300)) * 2.0 ** rng.integers(-30, 3, (256, 1300))).astype(
      np.float32)
  x[1, :650] = np.abs(x[1, :650]) * 100                   # large terms of one sign
  e = np.frexp(np.abs(x).max(axis=1))[1]                   # |x| < 2^e
  scale = np.ldexp(np.float32(1), 44 - e)[:, None].astype(np.float32)
  exact = [sum(int(v) for v in np.trunc(row.astype(np.float64) * sc)) for row, sc in
           zip(x, scale[:, 0].astype(np.float64))]
  limbs = jax.jit(functools.partial(numerics._limb_sum, axis=1))
  got = np.asarray(limbs(scale, x))
  np.testing.assert_allclose(got, np.array(exact, np.float64), rtol=3 * 2.0 ** -24)
  perm = rng.permutation(1300)
  for parts in ((x[:, :5], x[:, 5:]), (x[:, :700], x[:, 700:]), (x[:, perm],)):
    np.testing.assert_array_equal(np.asarray(limbs(scale, *parts)), got)
  int64 = np.asarray(jax.jit(functools.partial(numerics._int64_sum, axis=1))(scale, x))
  np.testing.assert_array_equal(int64, np.array(exact, np.float32))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_value_exponents_bound_every_value_a_layer_computes(dtype):
  """|v| < 2^e for the values of a real layer's input norm and v_proj, at the inputs that come
  nearest the bound: all of x in the one channel a v row reads (a row with one weight), and x
  of the signs of a dense row's weights; and for random x. Without the sqrt(H) of the norm's
  largest entry the one-channel case breaks the bound."""
  hidden, n = 64, 8
  rng = np.random.default_rng(3)
  w = rng.standard_normal((n, hidden)).astype(np.float32)
  w[0] = 0.0
  w[0, 5] = 3.0                                   # a row that reads one channel
  norm = layers.RMSNorm(hidden, 1e-6, dtype)
  norm.weight[...] = jnp.asarray(rng.uniform(0.5, 2.0, hidden), dtype)
  rows = jnp.asarray(w, dtype)
  e = np.asarray(numerics.value_exponents(rows, norm.weight[...]))
  one_hot = np.zeros((1, hidden), np.float32)
  one_hot[0, 5] = 100.0
  xs = np.concatenate([one_hot, np.sign(w[1:2]), rng.standard_normal((32, hidden)) * 10])
  v = np.asarray(numerics.matmul(norm(jnp.asarray(xs, dtype)), rows).astype(dtype), np.float32)
  assert (np.abs(v) < 2.0 ** e).all()
  assert np.abs(v[0, 0]) > 2.0 ** (e[0] - 2)      # the one-channel row comes within 4x of it


@pytest.mark.parametrize("form", ATTENDS)
def test_attention_does_not_depend_on_where_the_keys_lie(form):
  """A query over 41 keys: 41 in the cache and 1 new (a decode step), 33 and 8 (a verified
  block), the block as a tree node beside 3 siblings and at another batch row: bitwise the same
  output. The default form differs between the first two."""
  rng = np.random.default_rng(2)
  h, kvh, d, s, n = 8, 2, 64, 128, 40
  q = rng.standard_normal((1, 1, 1, h, d)).astype(np.float32)
  k, v = (rng.standard_normal((1, kvh, s, d)).astype(np.float32) for _ in range(2))

  def split(cached, rows=1, others=0):
    new = n + 1 - cached
    k_new = np.repeat(k[:, :, cached:n + 1].transpose(0, 2, 1, 3)[:, None], rows, 0)
    v_new = np.repeat(v[:, :, cached:n + 1].transpose(0, 2, 1, 3)[:, None], rows, 0)
    qs = np.concatenate([q, rng.standard_normal((others, 1, 1, h, d)).astype(np.float32)])
    mask_old = np.broadcast_to(np.arange(s) < cached, (rows, 1, 1, s))
    mask_new = np.ones((rows, 1, 1, new), bool)
    return (qs[:rows], np.repeat(k, rows, 0), np.repeat(v, rows, 0), k_new, v_new, mask_old,
            mask_new)

  def tree(cached):
    """the query as node 3 of 4 siblings' chains: its ancestors are new tokens 0..2."""
    q4 = np.concatenate([rng.standard_normal((1, 1, 3, h, d)).astype(np.float32), q], 2)
    k_new = k[:, :, cached:n + 1].transpose(0, 2, 1, 3)[:, None]
    v_new = v[:, :, cached:n + 1].transpose(0, 2, 1, 3)[:, None]
    mask_new = np.tril(np.ones((4, 4), bool))[None, None]
    mask_old = np.broadcast_to(np.arange(s) < cached, (1, 1, 4, s))
    return q4, k, v, k_new, v_new, mask_old, mask_new

  e = _exponents(v, np.zeros((1, 1, 1, kvh, d), np.float32), 4)    # every split sees all of v
  invariant = jax.jit(lambda *args: ATTENDS[form](*args, e))
  one = np.asarray(invariant(*split(n)))[0, 0, 0]
  for got in (invariant(*split(33))[0, 0, 0], invariant(*split(n, rows=3, others=2))[0, 0, 0],
              invariant(*tree(n - 3))[0, 0, 3]):
    np.testing.assert_array_equal(np.asarray(got), one)
  default = jax.jit(layers.xla_attend)
  assert not np.array_equal(np.asarray(default(*split(n))), np.asarray(default(*split(33))))


ARCH = random_models.Arch(vocab=512, hidden=256, layers=2, heads=4, kv_heads=2, head_dim=64,
                          target_layer_ids=(0, 1))
SMALL = random_models.Arch(vocab=8, hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16,
                           draft_layers=1, block_size=4, target_layer_ids=(0, 1))


def _dirs(tmp_path, arch, seed):
  target, drafter = random_models.pair(arch, seed)
  target_dir, drafter_dir = random_models.write_hf(tmp_path, target, drafter)
  return str(target_dir), str(drafter_dir)


def _config(dirs, dtype: str, numerics_mode: str, method: str = "ar"):
  """The config experiments.decode would run (so config.numerics takes the runtime's path)."""
  config = common.base_config()
  config.update(method=method, dtype=dtype, numerics=numerics_mode, max_new_tokens=12,
                max_len=48)
  config.target.path, config.drafter.path = dirs[0], dirs[1] if method != "ar" else ""
  config.cure.update(tau_margin=1e9, v_max=16, topk=2, beam_width=3)   # a repair every block
  config.auto.update(budgets="1,12", costs="1.0,1.05", explore_every=3)  # auto drafts
  return config


def _prefill_logits(target, tokens, rows: int, chunk: int):
  """Logits of row 0 at every position, the first `rows` prompts prefilled `chunk` at a time."""
  cache = target.init_cache(rows, 64)

  @jax.jit
  def step(tok, pos, cache, count):
    out = target(tok, pos, cache, prefix_attention.Prefix(cache.lengths, count))
    return target.logits(out.hidden), out.k, out.v

  logits = []
  for start in range(0, tokens.shape[1], chunk):
    tok = jnp.asarray(tokens[:rows, start:start + chunk])
    count = jnp.full((rows,), tok.shape[1], jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(start, start + tok.shape[1]), tok.shape)
    lg, k, v = step(tok, pos, cache, count)
    cache = cache.replace(k=k, v=v).advance(count)
    logits.append(np.asarray(lg[0]))
  return np.concatenate(logits)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_logits_do_not_depend_on_batch_or_chunk(dtype, tmp_path):
  """A prompt's logits at all 20 positions, prefilled alone in one chunk, beside 2 other prompts,
  token by token beside 7, in chunks of 5 beside 2: bitwise the same in invariant mode; the
  default mode's differ."""
  dirs = _dirs(tmp_path, ARCH, seed=1)
  tokens = np.random.default_rng(0).integers(0, ARCH.vocab, (8, 20)).astype(np.int32)
  ways = [(3, 20), (8, 1), (3, 5)]
  for mode, same in (("invariant", True), ("default", False)):
    target = pipeline.load_target(_config(dirs, dtype, mode))
    alone = _prefill_logits(target, tokens, 1, 20)
    equal = [np.array_equal(_prefill_logits(target, tokens, r, c), alone) for r, c in ways]
    assert all(equal) if same else not all(equal), (mode, equal)


# per dtype, (method, batch): every method in float32; in bfloat16, where near-ties are common,
# the verification passes of a chain and a tree
RUNS = {"float32": [("ar", 12), ("chain", 4), ("ddtree", 4), ("cure", 4), ("auto", 4)],
        "bfloat16": [("chain", 4), ("ddtree", 4)]}


@pytest.mark.parametrize("dtype", RUNS)
def test_every_method_at_any_batch_emits_target_only_tokens_at_batch_1(dtype, tmp_path):
  """Greedy decoding in invariant numerics: each prompt's tokens equal target-only decoding of
  that prompt alone, for every method at batch 4 and target-only at batch 12."""
  dirs = _dirs(tmp_path, SMALL, seed=4)
  prompts = random_models.prompts(9, SMALL.vocab, 12, lo=3, hi=30)
  target = pipeline.load_target(_config(dirs, dtype, "invariant"))
  alone = pipeline.decode_all(pipeline.make_generator(_config(dirs, dtype, "invariant"), target,
                                                      None), prompts, 1)
  for method, batch in RUNS[dtype]:
    config = _config(dirs, dtype, "invariant", method)
    gen = pipeline.make_generator(config, target, pipeline.load_drafter(config, target))
    got = pipeline.decode_all(gen, prompts, batch)
    assert [r.output_ids for r in got] == [r.output_ids for r in alone], (method, batch)


def test_sampling_with_a_fixed_seed_emits_the_same_tokens_at_any_batch(tmp_path):
  """Temperature 1 in invariant numerics: each method's tokens for a prompt, decoded in batches
  of 4 (target-only: 12), equal that method's tokens for the prompt decoded alone with the same
  seed: every sequence samples from its own key (tree/sampling.row_keys). The draws are real:
  most prompts sample other tokens than greedy decoding emits. Not auto: its controller picks
  one node budget for the whole batch from every row's acceptance, so a row verifies other trees
  beside other rows, and a sampled walk through another tree draws other numbers (greedy, the
  tokens are the same; sampled, the distribution is)."""
  dirs = _dirs(tmp_path, SMALL, seed=4)
  prompts = random_models.prompts(9, SMALL.vocab, 12, lo=3, hi=30)
  target = pipeline.load_target(_config(dirs, "float32", "invariant"))
  greedy = pipeline.decode_all(pipeline.make_generator(_config(dirs, "float32", "invariant"),
                                                       target, None), prompts, 12)
  for method, batch in [run for run in RUNS["float32"] if run[0] != "auto"]:
    config = _config(dirs, "float32", "invariant", method)
    config.temperature = 1.0
    drafter = pipeline.load_drafter(config, target) if method != "ar" else None
    gen = pipeline.make_generator(config, target, drafter)
    alone = [r.output_ids for r in pipeline.decode_all(gen, prompts, 1)]
    assert [r.output_ids for r in pipeline.decode_all(gen, prompts, batch)] == alone, method
    if method == "ar":
      assert sum(a != g.output_ids for a, g in zip(alone, greedy)) >= 6
