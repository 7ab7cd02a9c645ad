"""A user's optimizers for the tests (`--optimizer user_optim:lamb`, `train.optimizer`): LAMB
with its own warmup-cosine schedule and weight decay, as a transformation and as a factory."""

import optax

STEPS = 12


def make_lamb() -> optax.GradientTransformation:
    """LAMB whose settings all live here (none come from the run's `train` section)."""
    sched = optax.warmup_cosine_decay_schedule(5e-3, 2e-2, 2, STEPS, 2e-3)
    return optax.lamb(sched, weight_decay=1e-3)


lamb = make_lamb()
needs_args = optax.lamb  # a factory that wants a learning rate: refused with a hint
not_an_optimizer = 3
