"""What a run tells: typed events and hooks, recovery records and metrics files, what it prints,
TensorBoard, comparing runs, and the generated config and event references."""
