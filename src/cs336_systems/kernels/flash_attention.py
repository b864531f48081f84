"""FlashAttention-2 as autograd Functions: a tiled pure-PyTorch version and a Triton version.

Both take Q of shape (..., N_q, d) and K, V of shape (..., N_k, d) with the same leading (batch) dims, return O
of Q's shape and dtype (the Triton version's laid out in V's dimension order), and save exactly one logsumexp tensor L of shape (..., N_q) (float32) beside Q, K, V, O.
Causal masking is top-left aligned: query i attends to keys j <= i (as `scaled_dot_product_attention`).

Backward passes:
- `FlashAttentionTriton`, with its backward as a choice (as the Triton tutorial's one `_attention` takes options):
  "triton", Triton kernels, one pass over key tiles (dK, dV) and one over query tiles (dQ); or "compiled", the
  recomputation in PyTorch (`flash_backward_reference`, equations 13-19) under `torch.compile` on CUDA.
- `FlashAttentionPyTorch`: the same recomputation backward.

The kernels run through a tier (`flash_tiers`: "portable", the Triton kernels of `flash_triton`, or "hopper"),
chosen per (device, dtype, head dim, causal) or forced by `tier=` / $CS336_FLASH_TIER; the backward runs the tier
of the forward that saved L. They are PyTorch operators (`torch.ops.cs336.flash_attention_forward` / `_backward`,
with fake implementations and the autograd formula registered), so torch.compile, at any shape and with dynamic
shapes, treats a launch as one opaque node. In eager mode `FlashAttentionTriton` calls the tier directly instead:
an operator call costs tens of microseconds of host time (its dispatch and torch.library's dynamo-disabled
wrapper), as much as the kernels themselves at short sequences; it still goes through the operators wherever they
must be seen: while torch.compile traces and under a dispatch mode (selective checkpointing's cache, fake tensors).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Callable

import torch
from torch import Tensor

from cs336_systems.kernels import flash_replay, flash_tiers, flash_triton
from cs336_systems.measure.timing import is_oom

PYTORCH_TILE_SIZE = 32  # tiles of the pure-PyTorch forward (>= 16 x 16, as the spec asks)
TRITON_DTYPES = flash_triton.DTYPES


# ----------------------------------------------------------------------------------------------------------
# Input validation: one clear error naming the argument and what is wrong.
# ----------------------------------------------------------------------------------------------------------
def _validate(Q: object, K: object, V: object, is_causal: object, *, for_triton: bool) -> None:
    for name, t in (("Q", Q), ("K", K), ("V", V)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"{name} must have shape (..., seq, d), got shape {tuple(t.shape)}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if Q.shape[:-2] != K.shape[:-2] or K.shape[:-2] != V.shape[:-2]:
        raise ValueError(
            f"Q, K, V must share their leading (batch) dims: Q {tuple(Q.shape)}, K {tuple(K.shape)}, "
            f"V {tuple(V.shape)}"
        )
    if K.shape != V.shape:
        raise ValueError(
            f"K and V must have the same shape (..., N_k, d): K {tuple(K.shape)}, V {tuple(V.shape)}"
        )
    if Q.shape[-1] != K.shape[-1]:
        raise ValueError(f"Q and K must have the same head dim d: Q {tuple(Q.shape)}, K {tuple(K.shape)}")
    if Q.shape[-2] == 0 or K.shape[-2] == 0:
        raise ValueError(f"sequence lengths must be >= 1: Q {tuple(Q.shape)}, K {tuple(K.shape)}")
    if not (Q.dtype == K.dtype == V.dtype):
        raise TypeError(f"Q, K, V must share one dtype: Q {Q.dtype}, K {K.dtype}, V {V.dtype}")
    if not Q.dtype.is_floating_point:
        raise TypeError(f"Q, K, V must be floating point, got {Q.dtype}")
    if not (Q.device == K.device == V.device):
        raise ValueError(f"Q, K, V must be on one device: Q {Q.device}, K {K.device}, V {V.device}")
    if not for_triton:
        return
    if (problem := flash_triton.unsupported_head_dim(Q.shape[-1])) is not None:
        raise ValueError(f"{problem}: Q {tuple(Q.shape)}")
    if Q.dtype not in TRITON_DTYPES:
        raise TypeError(
            f"Q, K, V dtype {Q.dtype} is not supported by the Triton kernels; use one of {TRITON_DTYPES}"
        )
    if Q.device.type != "cuda" and not flash_triton.INTERPRET:
        raise ValueError(
            f"the Triton kernels need CUDA tensors, but Q is on {Q.device}; "
            "set TRITON_INTERPRET=1 before importing triton to run them on the CPU"
        )


# ----------------------------------------------------------------------------------------------------------
# Pure PyTorch: tiled forward with online softmax, and the recomputation backward.
# ----------------------------------------------------------------------------------------------------------
def tiled_forward_pytorch(
    Q: Tensor, K: Tensor, V: Tensor, is_causal: bool, tile_size: int = PYTORCH_TILE_SIZE
) -> tuple[Tensor, Tensor]:
    """Algorithm 1 in PyTorch, in float32 on the tiles: O (Q's dtype) and L (float32, shape (..., N_q))."""
    n_queries, d = Q.shape[-2:]
    n_keys = K.shape[-2]
    scale = 1.0 / math.sqrt(d)
    O = torch.empty(Q.shape, dtype=torch.float32, device=Q.device)
    L = torch.empty(Q.shape[:-1], dtype=torch.float32, device=Q.device)
    for q_start in range(0, n_queries, tile_size):
        q_end = min(q_start + tile_size, n_queries)
        q = Q[..., q_start:q_end, :].float()
        m = torch.full(q.shape[:-1], float("-inf"), device=Q.device)
        l = torch.zeros(q.shape[:-1], device=Q.device)
        acc = torch.zeros(q.shape, device=Q.device)
        rows = torch.arange(q_start, q_end, device=Q.device)
        # Key tiles that start after the tile's last query are fully masked: skip them.
        keys_end = min(n_keys, q_end) if is_causal else n_keys
        for k_start in range(0, keys_end, tile_size):
            k_end = min(k_start + tile_size, n_keys)
            k, v = K[..., k_start:k_end, :].float(), V[..., k_start:k_end, :].float()
            s = q @ k.transpose(-1, -2) * scale
            if is_causal and k_end - 1 > q_start:  # the tile crosses the diagonal
                cols = torch.arange(k_start, k_end, device=Q.device)
                s = s.masked_fill(cols[None, :] > rows[:, None], float("-inf"))
            # Key 0 is in every row's first tile, so m_new is finite from the first tile on.
            m_new = torch.maximum(m, s.amax(dim=-1))
            p = torch.exp(s - m_new[..., None])
            alpha = torch.exp(m - m_new)
            l = alpha * l + p.sum(dim=-1)
            acc = alpha[..., None] * acc + p @ v
            m = m_new
        O[..., q_start:q_end, :] = acc / l[..., None]
        L[..., q_start:q_end] = m + torch.log(l)
    return O.to(Q.dtype), L


def flash_backward_reference(
    Q: Tensor, K: Tensor, V: Tensor, O: Tensor, dO: Tensor, L: Tensor, is_causal: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward by recomputation (equations 13-19) in float32: P is rebuilt from L, no softmax needed."""
    scale = 1.0 / math.sqrt(Q.shape[-1])
    q, k, v, o, do = (t.float() for t in (Q, K, V, O, dO))
    S = q @ k.transpose(-1, -2) * scale
    if is_causal:
        above_diagonal = torch.ones(S.shape[-2:], dtype=torch.bool, device=S.device).triu(1)
        S = S.masked_fill(above_diagonal, float("-inf"))
    P = torch.exp(S - L[..., None])
    dV = P.transpose(-1, -2) @ do
    dP = do @ v.transpose(-1, -2)
    D = (o * do).sum(dim=-1, keepdim=True)
    dS = P * (dP - D)
    dQ = dS @ k * scale
    dK = dS.transpose(-1, -2) @ q * scale
    return dQ.to(Q.dtype), dK.to(K.dtype), dV.to(V.dtype)


def compiled_on_cuda(fn: Callable) -> Callable:
    """`fn` under `torch.compile` when its first argument is a CUDA tensor; eager on the CPU, and from the first
    compiler failure on (with a warning): the same math either way."""
    compiled: Callable | None = None
    failed = False

    @functools.wraps(fn)
    def run(*args):
        nonlocal compiled, failed
        if args[0].device.type != "cuda" or failed:
            return fn(*args)
        if compiled is None:
            compiled = torch.compile(fn)
        try:
            return compiled(*args)
        except Exception as exc:  # noqa: BLE001 - any compiler failure: fall back to the same math, eagerly
            if is_oom(exc):
                raise
            warnings.warn(
                f"torch.compile of {fn.__name__} failed ({exc!r}); running it eagerly", stacklevel=2
            )
            failed = True
            return fn(*args)

    return run


compiled_backward = compiled_on_cuda(flash_backward_reference)


# What both autograd Functions (and the forward operator's autograd formula) save: L, then the inputs and O.
def _save_for_backward(ctx, inputs: tuple, output: tuple) -> None:
    Q, K, V, is_causal, *tier = inputs
    O, L = output
    ctx.save_for_backward(L, Q, K, V, O)
    ctx.is_causal = is_causal
    ctx.tier = tier[0] if tier else None


class FlashAttentionPyTorch(torch.autograd.Function):
    """FlashAttention-2 in pure PyTorch: tiled forward, recomputation backward."""

    @staticmethod
    def forward(ctx, Q: Tensor, K: Tensor, V: Tensor, is_causal: bool = False) -> Tensor:
        _validate(Q, K, V, is_causal, for_triton=False)
        O, L = tiled_forward_pytorch(Q, K, V, is_causal)
        _save_for_backward(ctx, (Q, K, V, is_causal), (O, L))
        return O

    @staticmethod
    def backward(ctx, dO: Tensor):
        L, Q, K, V, O = ctx.saved_tensors
        return (*compiled_backward(Q, K, V, O, dO, L, ctx.is_causal), None)


# ----------------------------------------------------------------------------------------------------------
# Triton
# ----------------------------------------------------------------------------------------------------------
def _as_batched(x: Tensor) -> Tensor:
    """(..., seq, d) -> (batch, seq, d), what a tier takes: a view wherever the leading dims merge (a
    (batch, heads, seq, d) slice of the model's projections does at batch 1), a copy otherwise. The tier copies
    what its kernels cannot read in place (the portable tier: anything not contiguous)."""
    if x.dim() == 3:
        return x  # the common case skips a reshape: each costs about a microsecond of host time
    return x.reshape(-1, *x.shape[-2:])


def _batched_view(x: Tensor) -> Tensor | None:
    """x as (batch, seq, d) without a copy, or None where its leading dims do not merge."""
    if x.dim() == 3:
        return x
    try:
        return x.view(-1, *x.shape[-2:])
    except RuntimeError:
        return None


def _empty_output(Q: Tensor, V: Tensor) -> Tensor:
    """O's storage: Q's shape and dtype in V's dimension order. O's rows are mixtures of V's rows; a model whose V
    is a heads-last slice of its projection gets a heads-last O, which its output projection reads through a view
    instead of a copy. (Q's order would do the same only where Q is heads-last, which a model's RoPE need not keep;
    measured: kernels/hopper/FINDINGS.md.)"""
    # outermost first; the sort is stable, so dims of equal stride (size 1) keep their order
    order = sorted(range(V.dim()), key=V.stride, reverse=True)
    return torch.empty_permuted(Q.shape, order, dtype=Q.dtype, device=Q.device)


def _forward(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool, tier: str) -> tuple[Tensor, Tensor]:
    O = _empty_output(Q, V)
    out = _batched_view(O)
    o, L = flash_tiers.get(tier).forward(_as_batched(Q), _as_batched(K), _as_batched(V), is_causal, out)
    if out is None:  # a heads-last O at batch > 1: the tier's (batch * heads, seq, d) rows cannot view it
        O.copy_(o.view(Q.shape))
    return O, (L if Q.dim() == 3 else L.view(Q.shape[:-1]))


def _backward(
    Q, K, V, O, dO, L, is_causal: bool, tier: str, out=None, rope=None
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV; written into `out` (three tensors of Q's, K's and V's shapes, any strides) where given; dQ and dK
    rotated back by RoPE's tables `rope` = (cos, sin) where given (the tier's contract: flash_tiers)."""
    if L.dim() != 2:
        L = L.reshape(-1, Q.shape[-2])
    views = None if out is None else tuple(_batched_view(t) for t in out)
    if views is not None and any(v is None for v in views):
        views = None  # the tier's (batch * heads, seq, d) rows cannot view them (batch > 1): copies below
    dQ, dK, dV = flash_tiers.get(tier).backward(
        *map(_as_batched, (Q, K, V, O, dO)), L, is_causal, out=views, rope=rope
    )
    if out is not None:
        return tuple(
            t if views is not None else t.copy_(g.view(t.shape))
            for t, g in zip(out, (dQ, dK, dV), strict=True)
        )
    return (dQ, dK, dV) if Q.dim() == 3 else (dQ.view(Q.shape), dK.view(K.shape), dV.view(V.shape))


def _contiguous(*tensors: Tensor) -> bool:
    return all(t.is_contiguous() for t in tensors)


def _direct(Q: Tensor) -> bool:
    """Whether to call the tier directly rather than through the operators: not while torch.compile traces (its
    graph needs the opaque operator), not under a dispatch mode (selective checkpointing caches the operator's
    outputs, FakeTensorMode runs its fake implementation: neither sees a bare launch), not for tensor subclasses."""
    return (
        not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0 and type(Q) is Tensor
    )


# The kernels as PyTorch operators: torch.compile sees an opaque op whose output shapes come from the fake
# implementation, instead of tracing the launch (Python logic on sizes, shape-derived constexprs) into its graph,
# which fails as soon as a second shape makes the sizes symbolic. `tier` is a request (None: $CS336_FLASH_TIER or
# "auto"), resolved when the operator runs; the backward's request is the forward's, so both meet the same cached
# choice.
@torch.library.custom_op("cs336::flash_attention_forward", mutates_args=())
def flash_attention_forward(
    Q: Tensor, K: Tensor, V: Tensor, is_causal: bool, tier: str | None = None
) -> tuple[Tensor, Tensor]:
    """O (Q's shape and dtype, in V's dimension order) and the logsumexp L (Q.shape[:-1], float32, contiguous)."""
    _validate(Q, K, V, is_causal, for_triton=True)
    return _forward(Q, K, V, is_causal, flash_tiers.tier_for(Q, is_causal, tier))


@flash_attention_forward.register_fake
def _(Q: Tensor, K: Tensor, V: Tensor, is_causal: bool, tier: str | None = None) -> tuple[Tensor, Tensor]:
    _validate(Q, K, V, is_causal, for_triton=True)
    return _empty_output(Q, V), Q.new_empty(Q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("cs336::flash_attention_backward", mutates_args=())
def flash_attention_backward(
    Q: Tensor,
    K: Tensor,
    V: Tensor,
    O: Tensor,
    dO: Tensor,
    L: Tensor,
    is_causal: bool,
    tier: str | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """dQ, dK, dV (contiguous, in the shapes and dtype of Q, K, V)."""
    return _backward(Q, K, V, O, dO, L, is_causal, flash_tiers.tier_for(Q, is_causal, tier))


@flash_attention_backward.register_fake
def _(Q, K, V, O, dO, L, is_causal: bool, tier: str | None = None) -> tuple[Tensor, Tensor, Tensor]:
    return Q.new_empty(Q.shape), K.new_empty(K.shape), V.new_empty(V.shape)


def _backward_of_forward(ctx, dO: Tensor, dL: Tensor | None):
    L, Q, K, V, O = ctx.saved_tensors
    return (*flash_attention_backward(Q, K, V, O, dO, L, ctx.is_causal, ctx.tier), None, None)


# L is an output only for the autograd contract below; its gradient (dL) is never used.
flash_attention_forward.register_autograd(_backward_of_forward, setup_context=_save_for_backward)


# The backward passes FlashAttentionTriton can take.
TRITON_BACKWARDS = ("triton", "compiled")


class FlashAttentionTriton(torch.autograd.Function):
    """FlashAttention-2 in Triton (what the assignment's adapter returns): the forward kernel (Algorithm 1) of a
    tier (`flash_tiers`; `tier` forces one), and `backward` one of TRITON_BACKWARDS: "triton", the tier's
    atomic-free two-pass kernels, or "compiled", the PyTorch recomputation under torch.compile (the spec's part
    (d)). Eager calls run the tier directly, compiled ones through the operators (see the module docstring)."""

    @staticmethod
    def forward(
        ctx,
        Q: Tensor,
        K: Tensor,
        V: Tensor,
        is_causal: bool = False,
        backward: str = "triton",
        tier: str | None = None,
    ) -> Tensor:
        _validate(Q, K, V, is_causal, for_triton=True)  # before the op's schema sees a wrong type
        if backward not in TRITON_BACKWARDS:
            raise ValueError(f"backward must be one of {sorted(TRITON_BACKWARDS)}, got {backward!r}")
        ctx.resolved = _direct(Q)
        ctx.replay = None
        if ctx.resolved:
            # recorded only where a backward will follow: a plan needs both (and inference skips the cost)
            recordable = backward == "triton" and any(ctx.needs_input_grad[:3]) and _contiguous(Q, K, V)
            plan_key = flash_replay.key(Q, K, V, is_causal, tier) if recordable else None
            tier = flash_tiers.tier_for(Q, is_causal, tier)  # resolved now: the backward runs this tier
            if recordable and flash_replay.wanted(plan_key):
                with flash_replay.recording() as records:  # for launching this shape from C++ from now on
                    O, L = _forward(Q, K, V, is_causal, tier)
                ctx.replay = flash_replay.record_forward(plan_key, (Q, K, V), (O, L), records)
            else:
                O, L = _forward(Q, K, V, is_causal, tier)
        else:  # the operator resolves the request as it runs, and its backward the same request to the same tier
            O, L = flash_attention_forward(Q, K, V, is_causal, tier)
        _save_for_backward(ctx, (Q, K, V, is_causal, tier), (O, L))
        ctx.backward = backward
        return O

    @staticmethod
    def backward(ctx, dO: Tensor):
        L, Q, K, V, O = ctx.saved_tensors
        if ctx.backward == "compiled":
            grads = compiled_backward(Q, K, V, O, dO, L, ctx.is_causal)
        elif _direct(Q):
            tier = ctx.tier if ctx.resolved else flash_tiers.tier_for(Q, ctx.is_causal, ctx.tier)
            if ctx.replay is not None and dO.is_contiguous():
                with flash_replay.recording() as records:
                    grads = _backward(Q, K, V, O, dO, L, ctx.is_causal, tier)
                flash_replay.register(ctx.replay, (Q, K, V, O, dO, L), grads, records)
            else:
                grads = _backward(Q, K, V, O, dO, L, ctx.is_causal, tier)
        else:
            grads = flash_attention_backward(Q, K, V, O, dO, L, ctx.is_causal, ctx.tier)
        return (*grads, None, None, None)


# impl: the autograd Function and its arguments after (q, k, v, is_causal); TIERED take a tier after those.
IMPLEMENTATIONS: dict[str, tuple[type[torch.autograd.Function], tuple]] = {
    "triton": (FlashAttentionTriton, ("triton",)),
    "triton_compiled_backward": (FlashAttentionTriton, ("compiled",)),
    "pytorch": (FlashAttentionPyTorch, ()),
}
TIERED = ("triton", "triton_compiled_backward")


def flash_attention(
    q: Tensor, k: Tensor, v: Tensor, is_causal: bool = True, impl: str = "triton", tier: str | None = None
) -> Tensor:
    """Attention of q (..., N_q, d) over k, v (..., N_k, d), e.g. (batch, heads, seq, d_head), by FlashAttention-2;
    `tier` forces a kernel tier of the Triton implementations (see `flash_tiers`)."""
    if impl not in IMPLEMENTATIONS:
        raise ValueError(f"impl must be one of {sorted(IMPLEMENTATIONS)}, got {impl!r}")
    if (
        impl == "triton"
        and (plan := flash_replay.plan_for(q, k, v, is_causal, tier)) is not None
        and _direct(q)
    ):
        return flash_replay.attention(q, k, v, plan)  # a shape recorded before: launched from C++
    function, options = IMPLEMENTATIONS[impl]
    if impl in TIERED:
        return function.apply(q, k, v, is_causal, *options, tier)
    if tier is not None:
        raise ValueError(f"tier={tier!r} chooses among the Triton kernels; impl {impl!r} has none")
    return function.apply(q, k, v, is_causal)
