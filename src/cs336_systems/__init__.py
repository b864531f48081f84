"""CS336 systems: a Transformer LM, FlashAttention-2 kernels, DDP wrappers and a sharded optimizer."""
