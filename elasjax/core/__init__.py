"""The ground floor: names for the mesh's axes, keys per sample, micro-batch folding, layer
partitions, sharding helpers, tree sums, counters, the model contract, and the JAX version shims.
Imports nothing else of elasjax."""
