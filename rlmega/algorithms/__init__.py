"""RL math as pure tensor functions: advantages (per sequence), KL estimators and policy losses (per token).

Functions take tensors and scalars only, never a config object or a process group; shapes are in
each docstring. `rlmega.megatron` and the workers call them; nothing here knows about parallelism.
"""

from rlmega.algorithms import advantages, kl, losses

__all__ = ["advantages", "kl", "losses"]
