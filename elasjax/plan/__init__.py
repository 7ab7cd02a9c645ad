"""Choosing a plan: the cost-model planner over (data, stage, tensor) meshes, ZeRO storage over
the data axis, and the contingency plans prepared for likely failures."""
