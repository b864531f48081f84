"""The Hopper (sm_90) FlashAttention tier in Gluon: `supports`, `forward`, `backward` (see flash_attention.py).

Importing this package never imports gluon; the kernels are compiled on first launch."""

from cs336_systems.kernels.hopper.flash_attention import backward, forward, supports

__all__ = ["backward", "forward", "supports"]
