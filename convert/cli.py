"""The shared `python -m convert.<family>` command: an HF directory -> a converted orbax
checkpoint, or back with --to_hf. Bad input (a missing directory, a checkpoint of the other
kind, a wrong dtype) ends in one `error:` line, as in every entry point."""

from __future__ import annotations

from absl import flags

from cure_jax.runtime import errors


def run(what: str, convert_hf, export_hf) -> None:
  """Defines the flags (only when run as a script) and runs the conversion."""
  flags.DEFINE_string("hf_dir", None, f"{what} directory: the source, or with --to_hf the "
                      "destination.")
  flags.DEFINE_string("out", None, "Converted checkpoint directory: the destination, or with "
                      "--to_hf the source.")
  flags.DEFINE_enum("dtype", None, ["bfloat16", "float32"], "Parameter dtype (default: bfloat16 "
                    "when converting, the stored dtype with --to_hf).")
  flags.DEFINE_bool("to_hf", False, "Export the checkpoint at --out back to HF format in --hf_dir.")
  flags.DEFINE_integer("num_shards", 1, "With --to_hf: number of safetensors files to write.")
  flags.mark_flags_as_required(["hf_dir", "out"])

  def main(argv: list[str]) -> None:
    del argv
    args = flags.FLAGS
    if args.to_hf:
      written = export_hf(args.out, args.hf_dir, args.dtype, args.num_shards)
    else:
      written = convert_hf(args.hf_dir, args.out, args.dtype or "bfloat16")
    print(f"wrote {written}")

  errors.run(main)
