"""What a training run needs besides the model and its LightningModule (those are in models/):
callbacks (training/callbacks/, built from configs/callbacks/), the DDP strategy, checkpoint IO,
whole-config checks, the run directory and its files, loggers and the launcher's helpers.
train.py composes them."""
