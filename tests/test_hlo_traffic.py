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


def test_a_fused_gate_up_kernel_counts_both_expert_operands_as_routed():
  """gpu_grouped.swiglu's form: (bounds, source rows, tokens, gate, up), two stacked [E, in,
  out] operands; each counts the experts 3 tokens of top 2 reach, the tokens and indices whole
  (the tokens [3, 32], not a sorted copy)."""
  target = ('"__gpu$xla.gpu.triton", backend_config={debug = false, grid_x = 8 : i32, '
            'name = "moe_grouped_3x2", num_warps = 4 : i32}')
  hlo = f"""HloModule k, entry_computation_layout={{(s32[9]{{0}}, s32[22]{{0}}, bf16[3,32]{{1,0}}, bf16[8,32,64]{{2,1,0}}, bf16[8,32,64]{{2,1,0}})->bf16[22,64]{{1,0}}}}

ENTRY %main (b: s32[9], s: s32[22], x: bf16[3,32], g: bf16[8,32,64], u: bf16[8,32,64]) -> bf16[22,64] {{
  %b = s32[9]{{0}} parameter(0)
  %s = s32[22]{{0}} parameter(1)
  %x = bf16[3,32]{{1,0}} parameter(2)
  %g = bf16[8,32,64]{{2,1,0}} parameter(3)
  %u = bf16[8,32,64]{{2,1,0}} parameter(4)
  ROOT %k = bf16[22,64]{{1,0}} custom-call(%b, %s, %x, %g, %u), custom_call_target={target}
}}
"""
  out = hlo_traffic.count(hlo, {0: "bounds", 1: "source", 2: "x", 3: "gate", 4: "up"})["program"]
  reached = 8 * (1 - (1 - 2 / 8) ** 3)
  assert out["by_label"]["gate"] == pytest.approx(reached * EXPERT)
  assert out["by_label"]["up"] == pytest.approx(reached * EXPERT)
  assert out["by_label"]["x"] == 3 * 32 * 2 and out["by_label"]["source"] == 22 * 4
  assert out["by_label"]["activation"] == 22 * 64 * 2


SPLIT_K_HLO = """HloModule m, entry_computation_layout={(f32[8,16,40]{2,1,0})->bf16[16,8]{1,0}}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_slice (p0: f32[8,16,40]) -> bf16[16,8] {
  %p0 = f32[8,16,40]{2,1,0} parameter(0)
  %zero = f32[] constant(0)
  %r = f32[16,40]{1,0} reduce(%p0, %zero), dimensions={0}, to_apply=%add
  %c = bf16[16,40]{1,0} convert(%r)
  ROOT %sl = bf16[16,8]{1,0} slice(%c), slice={[0:16], [32:40]}
}

ENTRY %main (x: f32[8,16,40]) -> bf16[16,8] {
  %x = f32[8,16,40]{2,1,0} parameter(0)
  ROOT %f = bf16[16,8]{1,0} fusion(%x), kind=kLoop, calls=%fused_slice
}
"""


def test_a_slice_of_a_reduced_partial_reads_its_columns_of_every_split():
  """A fusion that reduces split-K partials [8, 16, 40] over the splits, converts and keeps
  columns 32:40 reads those 8 columns of all 8 splits, not the whole partial; with the slice
  taking everything it reads the whole."""
  out = hlo_traffic.count(SPLIT_K_HLO, {0: "partial"})["program"]
  assert out["by_label"]["partial"] == 8 * 16 * 8 * 4
  assert out["by_label"]["activation"] == 16 * 8 * 2
  whole = SPLIT_K_HLO.replace("[32:40]", "[0:40]").replace("bf16[16,8]", "bf16[16,40]")
  assert hlo_traffic.count(whole, {0: "partial"})["program"]["by_label"]["partial"] == (
      8 * 16 * 40 * 4)


COLLECTIVE_HLO = """HloModule m, num_partitions=8

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%body (p: (s32[], bf16[64,1024])) -> (s32[], bf16[64,1024]) {
  %p = (s32[], bf16[64,1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = bf16[64,1024]{1,0} get-tuple-element(%p), index=1
  %r = bf16[64,1024]{1,0} all-reduce(%x), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%sum
  ROOT %t = (s32[], bf16[64,1024]) tuple(%i, %r)
}

%cond (p: (s32[], bf16[64,1024])) -> pred[] {
  %p = (s32[], bf16[64,1024]) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %n = s32[] constant(3)
  ROOT %lt = pred[] compare(%i, %n), direction=LT
}

ENTRY %main (x: bf16[64,1024], y: f32[128,256]) -> (bf16[512,1024], f32[16,256], bf16[64,1024]) {
  %x = bf16[64,1024]{1,0} parameter(0)
  %y = f32[128,256]{1,0} parameter(1)
  %ag = bf16[512,1024]{1,0} all-gather(%x), replica_groups=[1,8]<=[8], dimensions={0}
  %rs = f32[16,256]{1,0} reduce-scatter(%y), replica_groups={}, dimensions={0}, to_apply=%sum
  %cp = bf16[64,1024]{1,0} collective-permute(%x), source_target_pairs={{0,1},{1,2}}
  %zero = s32[] constant(0)
  %init = (s32[], bf16[64,1024]) tuple(%zero, %cp)
  %w = (s32[], bf16[64,1024]) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %out = bf16[64,1024]{1,0} get-tuple-element(%w), index=1
  ROOT %t = (bf16[512,1024], f32[16,256], bf16[64,1024]) tuple(%ag, %rs, %out)
}
"""


def test_collectives_count_the_bytes_each_device_sends_by_the_ring_rule():
  """S = 64 x 1024 bf16 = 128 KiB. all-gather over 8: 7 S; reduce-scatter over all 8
  partitions (no groups named) of 128 KiB f32: 7/8 of it; permute: S; an all-reduce over
  groups of 4 in a loop of 3 trips: 3 x 2 x 3/4 S."""
  s = 64 * 1024 * 2
  out = hlo_traffic.count(COLLECTIVE_HLO)["program"]
  assert out["collectives"] == {"all-gather": 1, "all-reduce": 3, "collective-permute": 1,
                                "reduce-scatter": 1}
  assert out["collective_bytes"] == {"all-gather": 7 * s, "all-reduce": 3 * 1.5 * s,
                                     "collective-permute": s,
                                     "reduce-scatter": 7 / 8 * 128 * 256 * 4}


def test_dot_flops_count_fused_dots_and_loop_trips():
  """A [8, 64] x [64, 32] product (2 x 8 x 32 x 64 FLOPs) in a fori_loop of 5 trips, plus one
  [4, 16] x [16, 16] outside it: compiled by XLA, so the dots sit where it puts them."""
  w, v = jnp.ones((64, 32)), jnp.ones((16, 16))

  def f(x, w, y, v):
    z = jax.lax.fori_loop(0, 5, lambda i, x: jnp.tanh(x @ w) @ w.T, x)
    return z, y @ v

  out = _count(f, jnp.ones((8, 64)), w, jnp.ones((4, 16)), v)["program"]
  assert out["dot_flops"] == 5 * 2 * (2 * 8 * 32 * 64) + 2 * 4 * 16 * 16


CONVOLUTION_HLO = """HloModule m

%fused (p0: bf16[8,64], p1: bf16[64,32]) -> bf16[8,32] {
  %p0 = bf16[8,64]{1,0} parameter(0)
  %p1 = bf16[64,32]{1,0} parameter(1)
  ROOT %c = bf16[8,32]{1,0} convolution(%p0, %p1), dim_labels=bf_io->bf
}

%fused_t (p0: bf16[4,3,16], p1: bf16[24,3,16]) -> bf16[4,1,24] {
  %p0 = bf16[4,3,16]{2,1,0} parameter(0)
  %p1 = bf16[24,3,16]{2,1,0} parameter(1)
  ROOT %c = bf16[4,1,24]{2,1,0} convolution(%p0, %p1), window={size=3}, dim_labels=b0f_o0i->b0f
}

%fused_b (p0: f32[4,2,64,128], p1: bf16[4,32,2,128]) -> f32[4,2,64,32] {
  %p0 = f32[4,2,64,128]{3,2,1,0} parameter(0)
  %p1 = bf16[4,32,2,128]{3,2,1,0} parameter(1)
  ROOT %c = f32[4,2,64,32]{3,2,1,0} convolution(%p0, %p1), window={size=4x2 stride=3x1 pad=0_0x0_0 lhs_dilate=4x2}, dim_labels=01bf_0o1i->01bf
}

ENTRY %main (x: bf16[8,64], w: bf16[64,32], y: bf16[4,3,16], v: bf16[24,3,16], a: f32[4,2,64,128], k: bf16[4,32,2,128]) -> (bf16[8,32], bf16[4,1,24], f32[4,2,64,32]) {
  %x = bf16[8,64]{1,0} parameter(0)
  %w = bf16[64,32]{1,0} parameter(1)
  %y = bf16[4,3,16]{2,1,0} parameter(2)
  %v = bf16[24,3,16]{2,1,0} parameter(3)
  %a = f32[4,2,64,128]{3,2,1,0} parameter(4)
  %k = bf16[4,32,2,128]{3,2,1,0} parameter(5)
  %f = bf16[8,32]{1,0} fusion(%x, %w), kind=kOutput, calls=%fused
  %g = bf16[4,1,24]{2,1,0} fusion(%y, %v), kind=kOutput, calls=%fused_t
  %h = f32[4,2,64,32]{3,2,1,0} fusion(%a, %k), kind=kOutput, calls=%fused_b
  ROOT %t = (bf16[8,32], bf16[4,1,24], f32[4,2,64,32]) tuple(%f, %g, %h)
}
"""


def test_convolutions_count_as_the_dots_they_are():
  """The TPU compiler writes fused dots as convolutions: [8, 64] x [64, 32] (bf_io) is
  2 x 8 x 32 x 64 FLOPs; a kernel [24 out, 3 window, 16 in] over a window of 3 is
  2 x (4 x 24) x (3 x 16). A batched product written as windows (as the TPU compiler writes
  attention scores: dimensions 0 and 1 of sizes 4 and 2 dilated by their window, so each
  output sees one input of each) is 2 x (4 x 2) x 64 x 32 x 128, not 4 x 2 times that."""
  out = hlo_traffic.count(CONVOLUTION_HLO)["program"]
  assert out["dot_flops"] == (2 * 8 * 32 * 64 + 2 * 4 * 24 * 3 * 16
                              + 2 * 4 * 2 * 64 * 32 * 128)


CONCAT_HLO = """HloModule m

%fused_rows (p0: f32[256,64], p1: f32[256,32], p2: s32[16,1]) -> f32[16,96] {
  %p0 = f32[256,64]{1,0} parameter(0)
  %p1 = f32[256,32]{1,0} parameter(1)
  %p2 = s32[16,1]{1,0} parameter(2)
  %c = f32[256,96]{1,0} concatenate(%p0, %p1), dimensions={1}
  ROOT %g = f32[16,96]{1,0} gather(%c, %p2), offset_dims={1}, collapsed_slice_dims={0}, start_index_map={0}, index_vector_dim=1, slice_sizes={1,96}
}

ENTRY %main (a: f32[256,64], b: f32[256,32], i: s32[16,1]) -> f32[16,96] {
  %a = f32[256,64]{1,0} parameter(0)
  %b = f32[256,32]{1,0} parameter(1)
  %i = s32[16,1]{1,0} parameter(2)
  ROOT %f = f32[16,96]{1,0} fusion(%a, %b, %i), kind=kLoop, calls=%fused_rows
}
"""


def test_a_gather_through_a_concatenate_reads_its_rows_of_each_piece():
  """16 of 256 rows gathered from two pieces concatenated along the columns read those rows of
  each piece; a slice that cuts the concatenated columns could read any piece, so both count
  whole."""
  out = hlo_traffic.count(CONCAT_HLO, {0: "a", 1: "b"})["program"]["by_label"]
  assert out["a"] == 16 * 64 * 4 and out["b"] == 16 * 32 * 4
  cut = (CONCAT_HLO.replace("slice_sizes={1,96}", "slice_sizes={1,48}")
         .replace("f32[16,96]", "f32[16,48]"))
  out = hlo_traffic.count(cut, {0: "a", 1: "b"})["program"]["by_label"]
  assert out["a"] == 256 * 64 * 4 and out["b"] == 256 * 32 * 4
  rows = CONCAT_HLO.replace(
      "ROOT %g = f32[16,96]{1,0} gather(%c, %p2), offset_dims={1}, collapsed_slice_dims={0}, "
      "start_index_map={0}, index_vector_dim=1, slice_sizes={1,96}",
      "ROOT %g = f32[16,96]{1,0} slice(%c), slice={[64:80], [0:96]}")
  out = hlo_traffic.count(rows, {0: "a", 1: "b"})["program"]["by_label"]
  assert out["a"] == 16 * 64 * 4 and out["b"] == 16 * 32 * 4
