"""Looking at runs: per-block diagnostics, the offline repair-utility scorer, iteration replay
(trees kept), pictures, and tiny random model pairs for tests and losslessness sweeps; and what
the entry points report, importable from tests and notebooks:

  aot, aot_programs, aot_costs  compile-only reports for devices we do not have (experiments.aot)
  device_costs                  costs measured on the running accelerator
                                (experiments.device_costs)
  projection                    projected speed from compiled counts (experiments.projection)
  humaneval_exec                HumanEval completions run against their tests (Table 3)
  agreement                     where two decoders' outputs part; transformers as a reference
  random_pairs                  CURE against chain on random tiny pairs
"""
