"""Measured baselines that run as processes of their own (a full restart from a checkpoint)."""
