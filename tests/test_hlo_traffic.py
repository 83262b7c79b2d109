"""The HBM traffic count of optimized HLO (cure_jax/costs/hlo_traffic.py) on programs whose traffic
is known: weights read once, slices read what they take, in-place updates write the update,
on-chip buffers are not HBM, loop bodies count once per iteration, labels follow buffers."""


import jax
import jax.numpy as jnp
import pytest

from cure_jax.costs import hlo_traffic

H, N, S = 512, 1024, 4096


def _count(fn, *args, labels=None, donate=()):
  text = jax.jit(fn, donate_argnums=donate).lower(*args).compile().as_text()
  return hlo_traffic.count(text, labels)


def test_matrix_vector_reads_the_weight_once():
  w = jnp.zeros((H, N), jnp.float32)
  x = jnp.zeros((1, H), jnp.float32)
  out = _count(lambda w, x: jnp.tanh(x @ w), w, x, labels={0: "w"})["program"]
  assert out["by_label"]["w"] == w.nbytes
  assert out["hbm_bytes"] == pytest.approx(w.nbytes + x.nbytes + 4 * N, rel=0.01)


def test_slices_read_only_what_they_take_and_updates_write_only_the_update():
  cache = jnp.zeros((8, S, 64), jnp.float32)
  new = jnp.ones((8, 1, 64), jnp.float32)

  def step(cache, new, i):
    row = jax.lax.dynamic_slice_in_dim(cache, i, 1, axis=1)          # [8, 1, 64]
    return jax.lax.dynamic_update_slice_in_dim(cache, new + row, i, axis=1)

  out = _count(step, cache, new, jnp.int32(3), labels={0: "kv"}, donate=(0,))["program"]
  assert out["by_label"]["kv"] <= 4 * new.nbytes                      # never the whole cache
  assert out["hbm_bytes"] < 0.01 * cache.nbytes


def test_loop_body_counts_once_per_iteration_with_labels_flowing_in():
  w = jnp.zeros((H, H), jnp.float32)

  def loop(w, x):
    return jax.lax.fori_loop(0, jax.lax.convert_element_type(x[0, 0], jnp.int32) + 5,
                             lambda i, x: jnp.tanh(x @ w), x)

  out = _count(loop, w, jnp.zeros((1, H), jnp.float32), labels={0: "w"})
  (it,) = out["loops"]
  assert it["by_label"]["w"] == w.nbytes                               # one read per iteration
  assert out["outside_loops"]["by_label"].get("w", 0) == 0


HLO = """HloModule m, entry_computation_layout={(bf16[1024,256]{1,0})->bf16[1,256]{1,0}}

%fused (p0: bf16[1024,256], p1: bf16[1,1024]) -> bf16[1,256] {
  %p0 = bf16[1024,256]{1,0:T(8,128)(2,1)S(1)} parameter(0)
  %p1 = bf16[1,1024]{1,0:T(2,128)(2,1)} parameter(1)
  ROOT %d = bf16[1,256]{1,0:T(2,128)(2,1)} dot(%p1, %p0), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (w: bf16[1024,256], x: bf16[1,1024]) -> bf16[1,256] {
  %w = bf16[1024,256]{1,0:T(8,128)(2,1)} parameter(0)
  %x = bf16[1,1024]{1,0:T(2,128)(2,1)} parameter(1)
  %cs = (bf16[1024,256]{1,0:T(8,128)(2,1)S(1)}, bf16[1024,256]{1,0:T(8,128)(2,1)}, u32[]{:S(2)}) copy-start(%w)
  %cd = bf16[1024,256]{1,0:T(8,128)(2,1)S(1)} copy-done(%cs)
  ROOT %f = bf16[1,256]{1,0:T(2,128)(2,1)} fusion(%cd, %x), kind=kOutput, calls=%fused
}
"""


def test_prefetched_weights_count_their_hbm_read_once_and_on_chip_reads_apart():
  out = hlo_traffic.count(HLO, {0: "w", 1: "x"})["program"]
  w_bytes = 1024 * 256 * 2
  assert out["by_label"] == {"w": w_bytes, "x": 2048, "activation": 512}
  assert out["on_chip_bytes_skipped"] == w_bytes


KERNEL_HLO = """HloModule k, entry_computation_layout={(bf16[2,4096,128]{2,1,0})->bf16[2,16,128]{2,1,0}}

ENTRY %main (k: bf16[2,4096,128], q: bf16[2,16,128]) -> bf16[2,16,128] {
  %k = bf16[2,4096,128]{2,1,0:T(8,128)(2,1)} parameter(0)
  %q = bf16[2,16,128]{2,1,0:T(8,128)(2,1)} parameter(1)
  ROOT %a = bf16[2,16,128]{2,1,0:T(8,128)(2,1)} custom-call(%q, %k), custom_call_target="tpu_custom_call"
}
"""


def test_a_tpu_kernel_counts_its_operands_and_result():
  out = hlo_traffic.count(KERNEL_HLO, {0: "kv", 1: "q"})["program"]
  assert out["kernels"] == 1 and out["fusions"] == 0
  assert out["by_label"] == {"kv": 2 * 4096 * 128 * 2, "q": 2 * 16 * 128 * 2,
                             "activation": 2 * 16 * 128 * 2}


TRITON_HLO = """HloModule t, entry_computation_layout={(bf16[2,4096,128]{2,1,0})->f32[2,4,16,128]{3,2,1,0}}

ENTRY %main (k: bf16[2,4096,128], q: bf16[2,16,128]) -> f32[2,4,16,128] {
  %k = bf16[2,4096,128]{2,1,0} parameter(0)
  %q = bf16[2,16,128]{2,1,0} parameter(1)
  %a = (f32[2,4,16,128]{3,2,1,0}, f32[2,4,16]{2,1,0}) custom-call(%q, %k), custom_call_target="__gpu$xla.gpu.triton"
  ROOT %o = f32[2,4,16,128]{3,2,1,0} get-tuple-element(%a), index=0
}
"""


def test_a_triton_kernel_is_a_kernel_and_counts_its_whole_operands_and_results():
  """GPU rule: gpu_attention's Pallas (Triton) call is one kernel; the cache counts whole (the
  kernel reads only its filled part, which the HLO does not say), and so do all its results."""
  out = hlo_traffic.count(TRITON_HLO, {0: "kv", 1: "q"})["program"]
  assert out["kernels"] == 1 and out["fusions"] == 0
  assert out["by_label"] == {"kv": 2 * 4096 * 128 * 2, "q": 2 * 16 * 128 * 2,
                             "activation": 2 * 4 * 16 * 128 * 4 + 2 * 4 * 16 * 4}


def test_bad_text_is_rejected():
  with pytest.raises(ValueError, match="ENTRY"):
    hlo_traffic.count("HloModule m\n")


CUBLAS_HLO = """HloModule g, entry_computation_layout={(bf16[256,512]{1,0}, bf16[4,256]{1,0})->bf16[4,512]{1,0}}

ENTRY %main (w: bf16[256,512], x: bf16[4,256]) -> bf16[4,512] {
  %w = bf16[256,512]{1,0} parameter(0)
  %x = bf16[4,256]{1,0} parameter(1)
  %mm = (bf16[4,512]{1,0}, s8[4194304]{0}) custom-call(%x, %w), custom_call_target="__cublas$lt$matmul"
  ROOT %r = bf16[4,512]{1,0} get-tuple-element(%mm), index=0
}
"""


def test_a_cublas_call_counts_operands_and_result_but_not_its_workspace():
  """GPU rule: the s8 workspace cuBLAS returns beside its result is scratch (4 MB here, more
  than the whole matmul moves)."""
  out = hlo_traffic.count(CUBLAS_HLO, {0: "w", 1: "x"})["program"]
  assert out["by_label"] == {"w": 256 * 512 * 2, "x": 4 * 256 * 2, "activation": 4 * 512 * 2}
  assert out["hbm_bytes"] < 4194304


# 8 experts of [32, 64] bf16 (4 KB each), 16 token-slots.
RAGGED_HLO = """HloModule r, entry_computation_layout={(bf16[16,32]{1,0}, bf16[8,32,64]{2,1,0}, s32[8]{0})->bf16[16,64]{1,0}}

ENTRY %main (x: bf16[16,32], w: bf16[8,32,64], g: s32[8]) -> bf16[16,64] {
  %x = bf16[16,32]{1,0} parameter(0)
  %w = bf16[8,32,64]{2,1,0} parameter(1)
  %g = s32[8]{0} parameter(2)
  ROOT %rd = bf16[16,64]{1,0} ragged-dot(%x, %w, %g), lhs_contracting_dims={1}, rhs_contracting_dims={1}, lhs_ragged_dims={0}, rhs_group_dims={0}
}
"""

GATHER_HLO = """HloModule e, entry_computation_layout={(bf16[1,32]{1,0}, bf16[8,32,64]{2,1,0}, s32[2,1]{1,0})->bf16[1,2,64]{2,1,0}}

ENTRY %main (x: bf16[1,32], w: bf16[8,32,64], ids: s32[2,1]) -> bf16[1,2,64] {
  %x = bf16[1,32]{1,0} parameter(0)
  %w = bf16[8,32,64]{2,1,0} parameter(1)
  %ids = s32[2,1]{1,0} parameter(2)
  %slices = bf16[2,32,64]{2,1,0} gather(%w, %ids), offset_dims={1,2}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,32,64}
  ROOT %y = bf16[1,2,64]{2,1,0} dot(%x, %slices), lhs_contracting_dims={1}, rhs_contracting_dims={1}
}
"""
EXPERT = 32 * 64 * 2


def test_a_grouped_matmul_counts_every_expert():
  """ragged-dot: the group sizes are runtime values, so all 8 experts count, however few the
  16 token-slots route to."""
  out = hlo_traffic.count(RAGGED_HLO, {0: "x", 1: "experts", 2: "groups"})["program"]
  assert out["by_label"] == {"x": 16 * 32 * 2, "experts": 8 * EXPERT, "groups": 8 * 4,
                             "activation": 16 * 64 * 2}


def test_a_gather_of_expert_slices_counts_the_slices_it_takes():
  """2 of 8 experts read; their copy is written once and read again by the dot."""
  out = hlo_traffic.count(GATHER_HLO, {0: "x", 1: "experts", 2: "ids"})["program"]
  assert out["by_label"]["experts"] == 2 * EXPERT
  assert out["by_label"]["activation"] == 2 * (2 * EXPERT) + 2 * 64 * 2


def _grouped_kernel_hlo(tokens: int, top_k: int, tpu: bool) -> str:
  """A grouped-matmul kernel's custom call as the compilers write it: on a GPU the Triton call
  (bounds, rows padded by 16, experts) named in backend_config; on a TPU megablox's call
  (metadata, rows padded to a tile, experts) under the named scope in its op_name."""
  padded = tokens * top_k + 16
  target = ((f'"tpu_custom_call", backend_config={{"flag_configs":[]}}, metadata={{op_name='
                    f'"jit(f)/moe_grouped_{tokens}x{top_k}/jit(gmm)/pallas_call"}}')
                   if tpu else
                   (f'"__gpu$xla.gpu.triton", backend_config={{debug = false, grid_x = 8 : i32, '
                    f'name = "moe_grouped_{tokens}x{top_k}", num_warps = 4 : i32}}'))
  return f"""HloModule k, entry_computation_layout={{(s32[9]{{0}}, bf16[{padded},32]{{1,0}}, bf16[8,32,64]{{2,1,0}})->bf16[{padded},64]{{1,0}}}}

ENTRY %main (b: s32[9], x: bf16[{padded},32], w: bf16[8,32,64]) -> bf16[{padded},64] {{
  %b = s32[9]{{0}} parameter(0)
  %x = bf16[{padded},32]{{1,0}} parameter(1)
  %w = bf16[8,32,64]{{2,1,0}} parameter(2)
  ROOT %k = bf16[{padded},64]{{1,0}} custom-call(%b, %x, %w), custom_call_target={target}
}}
"""


@pytest.mark.parametrize("tokens,top_k,tpu", [(1, 2, False), (3, 2, False), (8, 1, True),
                                              (1, 2, True)])
def test_a_grouped_kernel_counts_the_experts_its_tokens_route_to(tokens, top_k, tpu):
  """Uniform routing: N tokens of top_k reach 8 (1 - (1 - top_k / 8)^N) of 8 experts — one
  token exactly top_k; the other operands and the result whole; a Pallas kernel."""
  out = hlo_traffic.count(_grouped_kernel_hlo(tokens, top_k, tpu),
                          {0: "bounds", 1: "x", 2: "experts"})["program"]
  reached = 8 * (1 - (1 - top_k / 8) ** tokens)
  assert out["by_label"]["experts"] == pytest.approx(reached * EXPERT)
  assert out["by_label"]["x"] == (tokens * top_k + 16) * 32 * 2
  assert out["kernels"] == 1
  if tokens == 1:
    assert out["by_label"]["experts"] == pytest.approx(top_k * EXPERT)


def test_a_kernel_without_the_name_counts_every_expert():
  """Any other Pallas call: operands whole (the upper bound)."""
  hlo = _grouped_kernel_hlo(3, 2, False).replace("moe_grouped_3x2", "other_kernel")
  out = hlo_traffic.count(hlo, {0: "bounds", 1: "x", 2: "experts"})["program"]
  assert out["by_label"]["experts"] == 8 * EXPERT
