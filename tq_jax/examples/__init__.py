"""Runnable examples of tq_jax in Flax NNX models (`python -m tq_jax.examples.generate`)."""
