"""DFlash drafter checkpoints, HF directory <-> converted orbax folder
(cure_jax/checkpoints/dflash.py does the work):

    python -m convert.dflash --hf_dir=Qwen3-8B-DFlash-b16 --out=ckpt/dflash-8b --dtype=bfloat16
    python -m convert.dflash --hf_dir=exported/dflash-8b --out=ckpt/dflash-8b --to_hf
"""

from convert import cli
from cure_jax.checkpoints import dflash

if __name__ == "__main__":
  cli.run("DFlash drafter HF", dflash.convert_hf, dflash.export_hf)
