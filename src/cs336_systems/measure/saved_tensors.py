"""Autograd residuals (2026 spec §3.1): the tensors a forward pass saves for backward, measured and counted.

Measured: `record_saved_tensors(module, x)` runs one forward under `torch.autograd.graph.saved_tensors_hooks` and
returns one record per saved tensor: its shape, dtype and bytes, the autograd node that saved it (found by
reading every node's saved tensors back after the forward), the tensor's producer (its grad_fn, or input /
parameter / buffer), the module whose forward was running (eager only: a compiled graph runs as one), and its
storage. A storage is counted once: a tensor whose storage is a parameter's (or a buffer's: module state, which
exists anyway), or an earlier saved tensor's, is flagged (`is_parameter`, `alias_of`) and not counted again; a
counted tensor costs its whole storage (a view keeps its base alive).

Analytic: `analytic_residuals(...)` lists, from the dimensions alone, what each op of our model
(`cs336_systems.model.transformer`, float32) saves in eager mode, read from the model code and autograd's formulas
(derivatives.yaml): one entry per saved tensor, with the same columns, so the two can be compared row by row.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from cs336_systems.model.transformer import ModelConfig, RMSNorm, TransformerBlock

MODULES = ("rmsnorm", "block")
MODES = ("eager", "compiled")
ANALYTIC_ATTENTION = ("naive", "flash_triton")


def _storage_key(t: torch.Tensor) -> tuple:
    # Live storages never share a data pointer (a saved tensor keeps its storage alive until backward), except
    # empty ones, which all point at 0: key those by the tensor object.
    storage = t.untyped_storage()
    if storage.nbytes() == 0:
        return ("empty", id(t))
    return (t.device.type, t.device.index, storage.data_ptr())


def _node_name(node) -> str:
    return type(node).__name__ if not hasattr(node, "name") else node.name()


def _saving_nodes(output: torch.Tensor, unpacked: list[int]) -> dict[int, str]:
    """Index of each saved tensor -> name of the autograd node that saved it: read back every node's saved
    tensors (the unpack hook appends the index it unpacks to `unpacked`)."""
    saved_by: dict[int, str] = {}
    seen, todo = set(), [output.grad_fn]
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        # Built-in nodes expose `_saved_<name>`; custom and compiled Functions expose `saved_tensors`.
        names = [a for a in dir(node) if a.startswith("_saved_")] + ["saved_tensors"]
        for name in names:
            unpacked.clear()
            try:
                getattr(node, name)
            except (AttributeError, RuntimeError):
                continue
            for index in unpacked:
                saved_by.setdefault(index, _node_name(node))
        todo += [next_node for next_node, _ in node.next_functions]
    return saved_by


def _module_tracker(module: nn.Module) -> tuple[list[str], list]:
    """A stack of the submodule paths whose forward is running, kept by forward hooks, and the hooks' handles."""
    stack = [""]

    def leave(*_) -> None:  # a forward hook that returns something replaces the output
        stack.pop()

    handles = []
    for path, sub in module.named_modules():
        handles.append(sub.register_forward_pre_hook(lambda *_, path=path: stack.append(path)))
        handles.append(sub.register_forward_hook(leave))
    return stack, handles


def record_saved_tensors(module: nn.Module, x: torch.Tensor, track_modules: bool = True) -> list[dict]:
    """Run `module(x)` once (x requires grad) under saved-tensor hooks; one record per tensor saved for backward.

    `track_modules` names the submodule that saved each tensor (forward hooks: eager modules only)."""
    x = x.detach().requires_grad_()
    parameters = {_storage_key(p) for p in module.parameters()}
    buffers = {_storage_key(b) for b in module.buffers()}
    saved: list[torch.Tensor] = []
    where: list[str] = []
    unpacked: list[int] = []
    stack, handles = _module_tracker(module) if track_modules else ([""], [])

    def pack(t: torch.Tensor) -> int:
        saved.append(t)
        where.append(stack[-1])
        return len(saved) - 1

    def unpack(index: int) -> torch.Tensor:
        unpacked.append(index)
        return saved[index]

    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            y = module(x)
            saved_by = _saving_nodes(y, unpacked)
    finally:
        for handle in handles:
            handle.remove()
    input_key = _storage_key(x)
    first_of: dict[tuple, int] = {}
    records = []
    for index, t in enumerate(saved):
        key = _storage_key(t)
        is_parameter = isinstance(t, nn.Parameter) or key in parameters
        alias_of = first_of.setdefault(key, index)
        if is_parameter:
            producer = "parameter"
        elif key in buffers:
            producer = "buffer"
        elif key == input_key:
            producer = "input"
        else:
            producer = _node_name(t.grad_fn) if t.grad_fn is not None else "no grad_fn"
        # Parameters and buffers are the module's own state: saving them costs no memory.
        counted = not is_parameter and key not in buffers and alias_of == index
        storage_bytes = t.untyped_storage().nbytes()
        records.append(
            {
                "index": index,
                "module_path": where[index],
                "saved_by": saved_by.get(index, "unknown"),
                "producer": producer,
                "shape": "x".join(map(str, t.shape)),
                "dtype": str(t.dtype).removeprefix("torch."),
                "bytes": t.numel() * t.element_size(),
                "storage_bytes": storage_bytes,
                "is_parameter": is_parameter,
                "is_parameter_object": isinstance(t, nn.Parameter),
                "alias_of": None if alias_of == index else alias_of,
                "counted": counted,
                "counted_bytes": storage_bytes if counted else 0,
            }
        )
    return records


def totals(records: Iterable[dict]) -> dict:
    """Counted bytes (each non-parameter storage once), and the handout's way: every saved tensor's bytes except
    those that are `nn.Parameter` objects, aliases included."""
    records = list(records)
    return {
        "tensors": len(records),
        "storages": sum(r["counted"] for r in records),
        "counted_bytes": sum(r["counted_bytes"] for r in records),
        "handout_bytes": sum(r["bytes"] for r in records if not r["is_parameter_object"]),
    }


# ---------------------------------------------------------------------------------------------------------------
# Analytic count: what our model's ops save in eager mode, from the dimensions.
# ---------------------------------------------------------------------------------------------------------------
class _Saved:
    """Collects analytic records; `storage` names the storage a tensor lives in, so aliases are counted once."""

    def __init__(self) -> None:
        self.records: list[dict] = []
        self.storages: dict[str, tuple[int, bool]] = {}  # name -> (bytes, is_parameter)

    def add(
        self,
        module_path: str,
        op: str,
        shape: tuple,
        storage: str,
        storage_shape: tuple | None = None,
        dtype: str = "float32",
        parameter: bool = False,
        parameter_object: bool = False,
    ) -> None:
        size = 1 if dtype == "bool" else 4
        storage_bytes = math.prod(storage_shape or shape) * size
        first = storage not in self.storages
        self.storages.setdefault(storage, (storage_bytes, parameter))
        counted = first and not parameter
        self.records.append(
            {
                "module_path": module_path,
                "saved_by": op,
                "producer": "parameter" if parameter else storage,
                "shape": "x".join(map(str, shape)),
                "dtype": dtype,
                "bytes": math.prod(shape) * size,
                "storage_bytes": storage_bytes,
                "is_parameter": parameter,
                "is_parameter_object": parameter_object,  # the Parameter itself, not a view such as W^T
                "counted": counted,
                "counted_bytes": storage_bytes if counted else 0,
            }
        )

    def rmsnorm(self, path: str, x: str, batch: int, seq: int, d: int) -> None:
        """x * rsqrt(mean(x^2) + eps) * weight: pow saves x, rsqrt its result r, x * r both, (x r) * w both."""
        name = path or "rmsnorm"
        self.add(path, "PowBackward0", (batch, seq, d), x)
        self.add(path, "RsqrtBackward0", (batch, seq, 1), f"{name}.rsqrt")
        self.add(path, "MulBackward0", (batch, seq, 1), f"{name}.rsqrt")
        self.add(path, "MulBackward0", (batch, seq, d), x)
        self.add(path, "MulBackward0", (d,), f"{name}.weight", parameter=True, parameter_object=True)
        self.add(path, "MulBackward0", (batch, seq, d), f"{name}.x*rsqrt")

    def linear(self, path: str, x: str, rows: int, d_in: int, d_out: int, x_shape: tuple) -> None:
        """x @ W^T on a 3-d x: matmul flattens x to (rows, d_in) (a view) and mm saves it and W^T."""
        self.add(path, "MmBackward0", (rows, d_in), x, storage_shape=x_shape)
        self.add(path, "MmBackward0", (d_in, d_out), f"{path}.weight", parameter=True)


def analytic_residuals(
    module: str,
    batch: int,
    seq: int,
    d_model: int,
    d_ff: int = 0,
    num_heads: int = 1,
    attention: str = "naive",
) -> list[dict]:
    """What each op of `module` ("rmsnorm": our RMSNorm on (batch, seq, d_model); "block": one pre-norm
    Transformer block with `attention` "naive" or "flash_triton") saves for backward in eager float32."""
    if module not in MODULES:
        raise ValueError(f"module must be one of {MODULES}, got {module!r}")
    if attention not in ANALYTIC_ATTENTION:
        raise ValueError(f"no analytic count for attention {attention!r}; one of {ANALYTIC_ATTENTION}")
    s = _Saved()
    b, t, d, h = batch, seq, d_model, num_heads
    act = (b, t, d)
    if module == "rmsnorm":
        s.rmsnorm("", "input", b, t, d)
        return s.records
    dh = d // h
    s.rmsnorm("attn_norm", "input", b, t, d)
    s.linear("attn.qkv", "attn_norm.out", b * t, d, 3 * d, act)
    # RoPE, for q then k: cos and sin are indexed afresh per call; each is saved by two products (x * table).
    for which in ("q", "k"):
        for table in ("cos", "sin", "sin", "cos"):
            s.add("attn.rope", "MulBackward0", (t, dh // 2), f"rope.{table}({which})")
    if attention == "naive":
        # q @ k^T on 4-d tensors runs as bmm on (b h, t, dh) views; / sqrt(dh) by a Python scalar saves nothing.
        s.add("attn", "BmmBackward0", (b * h, t, dh), "q", storage_shape=act)
        s.add("attn", "BmmBackward0", (b * h, dh, t), "k", storage_shape=act)
        s.add("attn", "MaskedFillBackward0", (t, t), "~causal", dtype="bool")
        s.add("attn", "SoftmaxBackward0", (b, h, t, t), "probs")
        s.add("attn", "BmmBackward0", (b * h, t, t), "probs", storage_shape=(b, h, t, t))
        # v is a permuted view of the qkv output; flattening (b, h) for bmm copies it, except at batch 1, where
        # the view stays a view (of the whole qkv output).
        if b == 1:
            s.add("attn", "BmmBackward0", (b * h, t, dh), "attn.qkv.out", storage_shape=(b, t, 3 * d))
        else:
            s.add("attn", "BmmBackward0", (b * h, t, dh), "v (copy)", storage_shape=act)
    else:
        # The autograd Function saves L, Q, K, V, O; V is a view of the qkv projection's output, keeping all of it.
        op = "FlashAttentionTritonBackward"
        s.add("attn", op, (b, h, t), "logsumexp")
        s.add("attn", op, (b, h, t, dh), "q", storage_shape=act)
        s.add("attn", op, (b, h, t, dh), "k", storage_shape=act)
        s.add("attn", op, (b, h, t, dh), "attn.qkv.out", storage_shape=(b, t, 3 * d))
        s.add("attn", op, (b, h, t, dh), "o", storage_shape=act)
    # The output projection takes the heads as (b, t, d): the reshape copies naive attention's (b, h, t, dh)
    # output, and is a view of ours, whose O is laid out heads-last (in V's order), so it keeps O's storage.
    s.linear("attn.out", "attn.heads (copy)" if attention == "naive" else "o", b * t, d, d, act)
    s.rmsnorm("ffn_norm", "x + attn", b, t, d)
    s.linear("ffn.w1", "ffn_norm.out", b * t, d, d_ff, act)
    s.add("ffn", "SiluBackward0", (b, t, d_ff), "w1.out")
    s.linear("ffn.w3", "ffn_norm.out", b * t, d, d_ff, act)
    s.add("ffn", "MulBackward0", (b, t, d_ff), "silu.out")
    s.add("ffn", "MulBackward0", (b, t, d_ff), "w3.out")
    s.linear("ffn.w2", "silu*w3", b * t, d_ff, d, (b, t, d_ff))
    return s.records


# ---------------------------------------------------------------------------------------------------------------
# One configuration, measured.
# ---------------------------------------------------------------------------------------------------------------
def flash_unavailable(cfg: ModelConfig, device: torch.device) -> str | None:
    """Why our Triton FlashAttention cannot run this configuration here, or None."""
    from cs336_systems.kernels import flash_triton  # imports triton: only where flash is asked for

    if (problem := flash_triton.unsupported_head_dim(cfg.d_model // cfg.num_heads)) is not None:
        return problem
    if device.type != "cuda" and not flash_triton.INTERPRET:
        return "the Triton kernels need CUDA, or TRITON_INTERPRET=1 set before triton is imported"
    return None


def measure(
    module_name: str, mode: str, cfg: ModelConfig, batch_size: int, device: torch.device, seed: int = 0
) -> list[dict]:
    """The saved tensors of one forward of `module_name` ("rmsnorm": RMSNorm(d_model); "block": one Transformer
    block of `cfg`) on a random (batch, context_length, d_model) float32 input, eager or under torch.compile."""
    if module_name not in MODULES or mode not in MODES:
        raise ValueError(
            f"module must be one of {MODULES} and mode one of {MODES}: got {module_name!r}, {mode!r}"
        )
    torch.manual_seed(seed)
    module = (RMSNorm(cfg.d_model) if module_name == "rmsnorm" else TransformerBlock(cfg)).to(device)
    x = torch.randn(batch_size, cfg.context_length, cfg.d_model, device=device)
    if mode == "eager":
        return record_saved_tensors(module, x)
    torch._dynamo.reset()  # each configuration compiles afresh (no recompile limit across configurations)
    compiled = torch.compile(module, fullgraph=True)
    compiled(
        x.detach().requires_grad_()
    ).sum().backward()  # compile outside the hooks, as a training step would
    module.zero_grad(set_to_none=True)
    return record_saved_tensors(compiled, x, track_modules=False)
