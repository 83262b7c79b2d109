"""Serving: requests that come and go over the compiled loop, behind an OpenAI-style API.

  engine   slots over `decoding.iteration`: insert a prefilled request, run a chunk, retire
"""
