"""The paper's tables on the embedded default, one module each, run by `python -m
experiments.benchmark --table=...`: registry (names -> tables), bench (what they share: loaded
models, variants, decoding, summaries, outputs), table1, table3, table4, table5, diagnostic,
sweep, peers, trees."""
