"""Looking at runs: per-block diagnostics, the offline repair-utility scorer, iteration replay
(trees kept), pictures, and tiny random model pairs for tests and losslessness sweeps."""
