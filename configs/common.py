"""Fields shared by every decoding config; each config file overrides what differs."""

import ml_collections


def process_fields() -> dict:
  """The mesh's multi-process settings (cure_jax/runtime/distributed.py). Empty / 0 / -1: from
  the environment (JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, as
  experiments.launch sets them), else JAX's Cloud TPU / SLURM / Open MPI detection."""
  return dict(
      distributed=False,            # multi-host (TPU pod): jax.distributed.initialize() first
      coordinator="",               # host:port of process 0
      num_processes=0,
      process_id=-1,
      timeout_s=300,                # start-up: every process must join within this
      heartbeat_s=60,               # a process silent this long is dead; the others exit
  )


def base_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.method = "cure"            # ar | chain | cure | ddtree | hybrid | ar_draft | auto
  config.target = ml_collections.ConfigDict(dict(path=""))
  config.drafter = ml_collections.ConfigDict(dict(
      path="",                      # DFlash directory (chain, cure) or small Qwen3 (ar_draft)
      block_size=0,                 # 0: the drafter's own block size; for ar_draft gamma + 1
      gamma=4,                      # ar_draft: drafted tokens per iteration
      window=0,                     # DFlash: the drafter sees the last `window` context
                                    # positions plus its block; 0 = the whole context
      vocab=0,                      # DFlash: 0 = the whole vocabulary; N: the drafter scores
                                    # only the N most frequent tokens of the target's own
                                    # outputs on its training data (lossless: the target
                                    # verifies; cure_jax/runtime/draft_vocab.py)
      vocab_counts="",              # token counts file (.npz with `counts` [V] int); "" =
                                    # token_counts.npz next to the drafter's weights
  ))
  config.dtype = "float32"          # parameter dtype: float32 | bfloat16
  config.numerics = "default"       # default | invariant: the target's logits at a position
                                    # bitwise the same at any batch, tree or prefill chunk
                                    # (cure_jax/models/numerics.py; dense targets, CPU)
  config.layer_kernels = True       # NVIDIA GPUs: decoding's rows (up to 256) through each
                                    # dense target layer as five Pallas kernels
                                    # (cure_jax/models/kernels/gpu_layer.py); False:
                                    # XLA's fusions
  config.prompts = ""               # JSONL: {"prompt": text} or {"prompt_ids": [ints]} per line
  config.num_prompts = 0            # 0: all
  config.chat_template = True       # wrap text prompts in the tokenizer's chat template
  config.max_new_tokens = 128
  config.ignore_eos = False         # True: decode exactly max_new_tokens
  config.max_len = 0                # static cache length; 0: prompt + max_new_tokens. Set, one
                                    # compiled prefill serves every prompt up to it
  config.prefill_chunk = 0          # prompt tokens per prefill step (memory ~ chunk x max_len);
                                    # 0: the platform's measured default (GPU 2048, TPU/CPU 512)
  config.batch_size = 1
  config.mesh = ml_collections.ConfigDict(dict(
      data=1,                       # batch split over this many devices
      model=1,                      # tensor parallel: heads, MLP and vocabulary split this ways
      **process_fields(),
  ))                                # data * model must equal the device count; 1 x 1: no sharding
  config.temperature = 0.0         # 0: greedy (float32 greedy is token-exact vs target-only)
  config.top_k = 0                  # 0: off
  config.top_p = 1.0                # 1: off
  config.seed = 0                   # sampling is reproducible from this seed
  config.output = ""                # JSON path; empty: print text and a summary line
  config.check_ar = False           # also decode target-only and report token equality
  config.warmup = True              # decode the first batch once, untimed, before the timed
                                    # pass: TPOT of a warm program (a first run pays page faults);
                                    # auto: until its looks settle (at most 4 calls, decode.py)
  config.compilation_cache = ""     # JAX persistent compilation cache folder; "" = the cure_jax
                                    # cache folder's xla/ ($CURE_JAX_CACHE), "off" = no cache
  config.compiler_options = ""      # XLA options for the decoding programs, "name=value,...",
                                    # e.g. xla_gpu_experimental_force_split_k=1 on a GPU
  config.cure = ml_collections.ConfigDict(dict(
      tau_margin=1.0, margin_scale=2.0, b_min=1, b_max=5, dynamic=True, select="margin",
      max_repair_positions=1, v_max=64, max_depth=15, beam_width=5, keep_branch0=True,
      resync=True,
      topk=4,                       # ddtree: top-k per depth; hybrid: sibling leaves per node
      # Online budget (cure, hybrid): repair only while (τ0 + gain) / (C_d + C_r + C_v(v_max))
      # beats τ0 / (C_d + C_v(K)), from running means kept in the loop; C_v(n) = base + per_node
      # * n. Costs in any one unit (ms); all four 0: timed on this device at start-up and cached
      # (cure_jax/runtime/cost_curve.py), so an MoE target's steeper C_v(n) is what it sees.
      online=False, online_decay=0.8, explore_every=8,
      cost_draft=0.0, cost_redraft=0.0, cost_verify_base=0.0, cost_verify_per_node=0.0))
  # method=auto: each iteration a goodput controller picks one of these node budgets (1 = a
  # plain target step) for the batch, by expected tokens per second (cure_jax/tree/controller.py).
  # costs: seconds per budget; "" = timed on this device at start-up and cached. Looks at the
  # drafter while plain steps win come explore_every iterations apart (or further, so that they
  # cost at most explore_overhead of the time), twice as far after each one that does not pay.
  # fallback: decode target-only where no drafting budget could beat plain steps even if every
  # draft were accepted, and in a call that no look falls inside.
  config.auto = ml_collections.ConfigDict(dict(budgets="1,4,8,16", costs="", decay=0.8,
                                               explore_every=16, explore_overhead=0.02,
                                               fallback=True))
  return config
