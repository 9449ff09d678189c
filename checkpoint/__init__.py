"""Checkpoints: sealed local folders with a checksummed manifest (`manifest`), written by their
own process (`writer`), synced to object storage (`sync`, over `storage/`). Imports neither
`runner` nor `trainer`; kept import-free, since `python -m grpo_run.checkpoint.writer` imports it."""
