"""The candidate tree and its verification, in static shapes (every tree padded to v_max nodes).

  candidates  Tree (tokens, parent, depth, valid, branch, ancestor mask) and its construction
  repair      the uncertainty gate (margins, focal points, branch budgets) and repair paths
  best_first  best-first trees and leaves by cumulative draft log-probability (ddtree, hybrid)
  verify      greedy verification and the lossless stochastic walk
  sampling    temperature / top-k / top-p warping and draws
  budget      the online budget: repair only while the efficiency model says it pays
"""
