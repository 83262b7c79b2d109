"""An OpenAI-compatible server over the serving engine (docs/serving.md).

  python -m experiments.serve [--config=configs/smollm2_135m.py --config.method=cure ...] \
    [--host=127.0.0.1 --port=8000 --slots=8]

Takes every --config. flag experiments.decode takes; it prints one line when it is ready for
requests, and on SIGTERM finishes (or, after --drain_s, cancels) what runs and exits 0.
"""

from absl import flags

from cure_jax.runtime import errors

_CONFIG = errors.config_flag("configs/smollm2_135m.py", "ml_collections config file")
_HOST = flags.DEFINE_string("host", "127.0.0.1", "address to listen on")
_PORT = flags.DEFINE_integer("port", 8000, "port to listen on")
_SLOTS = flags.DEFINE_integer("slots", 8, "requests decoded at once (rows of the batch)")
_STEPS = flags.DEFINE_integer("steps", 8, "most iterations per compiled chunk between host turns")
_CHUNK_MS = flags.DEFINE_float("chunk_ms", 200.0, "milliseconds a chunk may take (fewer "
                               "iterations when many rows decode: a request arriving during a "
                               "chunk waits for it); 0: always --steps")
_WAITING = flags.DEFINE_integer("max_waiting", 64, "requests queued for a slot; more get 429")
_DRAIN = flags.DEFINE_float("drain_s", 30.0, "seconds running requests get after SIGTERM")
_MODEL = flags.DEFINE_string("model_name", "", "model id clients send (default: the target "
                             "directory's name)")


def main(argv):
  del argv
  from cure_jax.serving import server
  config = _CONFIG.value
  if _CHUNK_MS.value < 0:
    raise ValueError(f"--chunk_ms={_CHUNK_MS.value} must be >= 0 (0: every chunk --steps "
                     "iterations)")
  app, served = server.build(config, *server.load(config), _SLOTS.value, _STEPS.value,
                             _WAITING.value, _MODEL.value, _DRAIN.value,
                             _CHUNK_MS.value / 1000 or None)
  server.serve(app, served, _HOST.value, _PORT.value, _DRAIN.value, config.method)


if __name__ == "__main__":
  errors.run(main)
