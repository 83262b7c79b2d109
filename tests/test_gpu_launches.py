"""Kernels and host launches per iteration from XLA GPU's thunk-sequence dump
(cure_jax/costs/launches.py), on hand-written dumps whose counts are known."""

from cure_jax.costs import launches

# The layout XLA prints: a top-level loop whose `condition:` sits at the loop's own indent, a
# body of command buffers (CUDA graphs), a cuBLAS call outside them, a conditional with two
# branches and a nested loop.
DUMP = """\
001: kCustomKernel [source | next=002 (1)] wrapped_transpose grid: [8, 1, 1]
002: kWhile        [prev=001 (1) | next=030 (1)]
condition:
    003: kCustomKernel [source | sink] loop_and_fusion grid: [1, 1, 1]
  body:
    000: kCommandBuffer  [source | next=010 (1)]
        004: kCustomKernel [source | next=005 (1)] gemm_fusion_dot grid: [8, 1, 1]
        005: kCustomKernel [prev=004 (1) | next=006 (1)] input_reduce_fusion grid: [2, 1, 1]
        006: kCopy [prev=005 (1) | sink] copy
    010: kCublasLtMatmul [prev=000 (1) | next=011 (1)] kCublasLtMatmul
    011: kConditional    [prev=010 (1) | next=020 (1)]
      false_branch:
        012: kCustomKernel [source | sink] loop_select_fusion grid: [10, 1, 1]
      true_branch:
        000: kCommandBuffer  [source | sink]
            013: kCustomKernel [source | next=014 (1)] fusion_1 grid: [80, 1, 1]
            014: kCustomKernel [prev=013 (1) | sink] fusion_2 grid: [80, 1, 1]
    020: kWhile [prev=011 (1) | sink]
    condition:
        021: kCustomKernel [source | sink] compare_fusion grid: [1, 1, 1]
      body:
        022: kCustomKernel [source | sink] scan_step_fusion grid: [1, 1, 1]
030: kCustomKernel [prev=002 (1) | sink] loop_convert_fusion grid: [1, 1, 1]
"""


def test_one_iteration_counts_kernels_and_launches_by_the_stated_rules():
  it = launches.count(DUMP)["iteration"]
  # condition 1 + graph 3 + cuBLAS 1 + the larger branch 2 + nested loop (once) 2
  assert it["kernels"] == 9
  # condition 1 + graph 1 + cuBLAS 1 + the branch's graph 1 + nested loop's 2 kernels
  assert it["launches"] == 6
  assert it["command_buffers"] == 2 and it["nested_loops"] == 1
  assert it["captured_share"] == 5 / 9
  assert it["by_kind"] == {"kCustomKernel": 7, "kCopy": 1, "kCublasLtMatmul": 1}


def test_the_program_adds_what_runs_outside_the_loop():
  program = launches.count(DUMP)["program"]
  assert program["kernels"] == 11 and program["launches"] == 8


def test_a_program_without_a_loop_is_its_own_iteration():
  dump = "001: kCustomKernel [source | sink] a grid: [1, 1, 1]\n" \
         "000: kCommandBuffer [source | sink]\n" \
         "    002: kCustomKernel [source | sink] b grid: [1, 1, 1]\n"
  out = launches.count(dump)
  assert out["iteration"] == out["program"]
  assert out["program"]["kernels"] == 2 and out["program"]["launches"] == 2
