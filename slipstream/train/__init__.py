"""The training runtime: config, data, parallelism, the trainer, checkpoints and export."""
