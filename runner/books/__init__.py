"""The run's books, the one writer of its record: `books` (the record here and in storage, the
attempts, what the trainer reports), `ledger` (the spend and the budget), `evals` (the baseline
cache, evaluation batches, the held-out curve), `fingerprint` (what a cached evaluation depends
on), `trackers` (TensorBoard, MLflow, W&B)."""
