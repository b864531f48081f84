"""Plain softmax attention in float64 and the relative error the FlashAttention tests measure against it."""

import math

import torch


def reference(q, k, v, is_causal):
    """Plain softmax attention in float64: O and the logsumexp L of the scores."""
    q, k, v = (t.double() for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if is_causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return torch.softmax(s, dim=-1) @ v, torch.logsumexp(s, dim=-1)


def rel_err(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| / max |expected|; the absolute error where the reference is all zero (a softmax over
    one key has zero gradients: dQ and dK of a single token)."""
    error, scale = (actual.double() - expected).abs().max(), expected.abs().max()
    return (error / scale if scale > 0 else error).item()
