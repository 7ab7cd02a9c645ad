"""Moving state from one plan to another: shard bookkeeping, transition planning and its copies, checksums, the per-step snapshot pool and checkpoints."""
