"""Serving: requests that come and go over the compiled loop, behind an OpenAI-style API.

  engine     slots over `decoding.iteration`: prefill in turns, run a chunk on the live rows,
             retire
  programs   the engine's compiled programs (chunk, place, cancel, resize, prefill windows)
  scheduler  the engine's thread: admits, cancels and hands out tokens between chunks
  requests   OpenAI request bodies checked into jobs; OpenAI's error body
  text       token ids to text deltas, cut at stop strings
  metrics    Prometheus metrics, vLLM's names where vLLM has one
  app        the FastAPI app: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics
  server     from a decoding config to a listening uvicorn server
"""
