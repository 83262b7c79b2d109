"""A GGUF checkpoint (llama.cpp's format) -> a Hugging Face model directory
(cure_jax/checkpoints/gguf.py does the work):

    python -m convert.gguf --gguf=model.gguf --out=/tmp/model
"""

from absl import flags

from cure_jax.checkpoints import gguf
from cure_jax.runtime import errors


def main(argv: list[str]) -> None:
  del argv
  args = flags.FLAGS
  out = gguf.convert_gguf(args.gguf or gguf.default_smollm2_gguf(), args.out,
                          overwrite=args.overwrite)
  print(f"Wrote Hugging Face model to {out}")


if __name__ == "__main__":
  flags.DEFINE_string("gguf", None, "GGUF file to convert (default: the packaged "
                      "SmolLM2-135M-Instruct).")
  flags.DEFINE_string("out", None, "Output Hugging Face model directory.")
  flags.DEFINE_bool("overwrite", False, "Replace --out if it exists and is not empty.")
  flags.mark_flag_as_required("out")
  errors.run(main)
