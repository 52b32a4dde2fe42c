"""wandb's run printer kept quiet by the training and eval commands: the settings wandb.init takes for it,
and the one line each command prints instead."""

from __future__ import annotations

from runs.command_line import verbose


def wandb_init_settings() -> dict:
    """Keyword arguments for wandb.init (and Lightning's WandbLogger, which passes them on): wandb's
    run printer silent (its header lines and the run history and summary block at the end) unless
    the command line asked for verbose output. wandb's own warnings and errors still print."""
    if verbose():
        return {}
    import wandb

    return {"settings": wandb.Settings(silent=True)}


def where_wandb_keeps(run) -> str:
    """Where a wandb run is, for the one line that replaces wandb's own: its page online, its local
    folder (and how to upload it) offline."""
    if run.offline:
        return f"wandb offline run {run.settings.sync_dir} (upload: wandb sync {run.settings.sync_dir})"
    return f"wandb run {run.url}"
