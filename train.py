"""attnlab training entry point in a clone: `python train.py attn=alsc` (an installed attnlab has the
same command as `attnlab-train attn=alsc`); the code is training/train.py. See README.md."""

from training.train import cli

if __name__ == "__main__":
    cli()
