"""Memory accounting of naive attention from formulas (spec §1.2.1), in bytes.

The accounted code is `cs336_systems.model.transformer.naive_attention` applied to Q, K, V of shape (batch, seq, d), as
the attention benchmark runs it:

    scores = Q @ K^T / sqrt(d)            # (batch, seq, seq); the unscaled product is a temporary
    mask   = ones(seq, seq).tril()        # bool, 1 byte per entry; `~mask` is kept for backward
    scores = scores.masked_fill(~mask, -inf)
    probs  = softmax(scores)              # kept for backward
    out    = probs @ V                    # (batch, seq, d)

Saved for backward (unique storages): Q and K (for Q K^T), the inverted bool mask (masked_fill), the softmax
output (softmax and probs @ V share it), and V. The division by a Python scalar saves no tensor.
"""

from __future__ import annotations

from cs336_systems.accounting.units import MIB


def naive_attention_memory(batch: int, seq: int, d: int, dtype_bytes: int = 4) -> dict[str, int]:
    """Bytes of each tensor class of naive attention and the totals the benchmark can measure.

    Terms (B = batch, S = seq, b = dtype_bytes):
      qkv                3 B S d b      the inputs
      output             B S d b
      grad_output        B S d b        dO, allocated by the benchmark before the forward pass
      score_matrix       B S^2 b        one (S x S) matrix per batch element; forward creates four of them
                                        (Q K^T, scaled, masked, softmax) but at most two are alive at a time
      mask               S^2            bool; the causal mask (`mask` and `~mask` are both alive in forward)
      softmax_output     B S^2 b
      saved_for_backward qkv + ~mask + softmax_output
      grad_qkv           3 B S d b
      before_backward    qkv + output + grad_output + saved tensors other than Q, K, V:
                         what is allocated right before `out.backward(dO)`
      forward_peak       qkv + grad_output + 2 score matrices + both masks + output
      backward_peak      before_backward + dV + dP (= dO V^T) + dS (softmax backward):
                         the softmax backward step, where probs, dP and dS are alive together
    """
    for name, value in (("batch", batch), ("seq", seq), ("d", d), ("dtype_bytes", dtype_bytes)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"naive_attention_memory: {name} must be a positive int, got {value!r}")
    vector = batch * seq * d * dtype_bytes  # one (B, S, d) tensor
    square = batch * seq * seq * dtype_bytes  # one (B, S, S) tensor
    mask = seq * seq  # bool, one byte per entry
    terms = {
        "qkv": 3 * vector,
        "output": vector,
        "grad_output": vector,
        "score_matrix": square,
        "mask": mask,
        "softmax_output": square,
        "grad_qkv": 3 * vector,
    }
    terms["saved_for_backward"] = terms["qkv"] + mask + square
    terms["before_backward"] = terms["qkv"] + vector + vector + mask + square
    # During the forward pass at most two (B, S, S) matrices are alive: (QK^T, scaled), (scaled, masked),
    # (masked, probs); the local `mask` and the saved `~mask` are both alive until the function returns.
    terms["forward_peak"] = terms["qkv"] + vector + 2 * square + 2 * mask + vector
    terms["backward_peak"] = terms["before_backward"] + vector + 2 * square
    return terms


def mib(n_bytes: float) -> float:
    return n_bytes / MIB
