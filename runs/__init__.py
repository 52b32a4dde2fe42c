"""A training run as files, below both training/ and eval/: its directory (`runs.run.Run`: config,
checkpoints, tokenizer, results, label, wandb group, where its evaluations go), its checkpoint files
(`runs.checkpoints`: atomic writes, weights-only reads, content digests), the model a checkpoint
rebuilds (`runs.model`), and what the training and eval commands share about the process that reads
or writes a run: where the Hydra configs are (`runs.config_dir`), `-v` and the user error's exit status
(`runs.command_line`), wandb's quiet settings (`runs.wandb_quiet`)."""
