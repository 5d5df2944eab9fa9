"""KL estimators between the current policy and a reference, per token (Schulman 2020).

delta = logp - ref_logp for tokens sampled from the current policy:
  k1 = delta                        unbiased, can be negative
  k2 = delta**2 / 2                 biased; its gradient is the true KL gradient
  k3 = exp(-delta) - 1 + delta      unbiased and >= 0 (GRPO's D_KL)
"""

import jax.numpy as jnp


def k1(logp, ref_logp):
  return logp - ref_logp


def k2(logp, ref_logp):
  return 0.5 * jnp.square(logp - ref_logp)


def k3(logp, ref_logp):
  # Clamped as in verl so that one far-off token cannot overflow the loss.
  delta = jnp.clip(logp - ref_logp, -20.0, 20.0)
  return jnp.clip(jnp.exp(-delta) - 1.0 + delta, -10.0, 10.0)


ESTIMATORS = {"k1": k1, "k2": k2, "k3": k3}
