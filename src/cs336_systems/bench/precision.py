"""Mixed precision on small cases (spec §1.1.5, ADDENDUM.md): how float formats accumulate, and which dtypes
torch.autocast gives the ToyModel's activations, loss and gradients."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from cs336_systems.model.toy import ToyModel

EXACT_SUM = 10.0
ADDEND = 0.01
STEPS = 1000

# (variant, accumulator dtype, addend dtype, how the addend reaches the accumulator)
ACCUMULATION_VARIANTS = (
    (1, torch.float32, torch.float32, "same dtype"),
    (2, torch.float16, torch.float16, "same dtype"),
    (3, torch.float32, torch.float16, "type promotion"),
    (4, torch.float32, torch.float16, "explicit cast to float32"),
)
# The quantities observed under autocast, in the order of the question.
QUANTITIES = ("parameters", "fc1 output", "layernorm output", "logits", "loss", "gradients")


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def accumulate(acc_dtype: torch.dtype, addend_dtype: torch.dtype, cast_to_acc: bool) -> torch.Tensor:
    """Add ADDEND (stored as `addend_dtype`) STEPS times into a zero accumulator of `acc_dtype`."""
    total = torch.tensor(0.0, dtype=acc_dtype)
    addend = torch.tensor(ADDEND, dtype=addend_dtype)
    for _ in range(STEPS):
        total += addend.to(acc_dtype) if cast_to_acc else addend
    return total


def accumulation_rows() -> list[dict]:
    """The four accumulation loops of ADDENDUM.md (exact answer 10): one row per loop, its value and |error|."""
    rows = []
    for variant, acc_dtype, addend_dtype, how in ACCUMULATION_VARIANTS:
        total = accumulate(acc_dtype, addend_dtype, cast_to_acc=how.startswith("explicit"))
        value = total.item()
        rows.append(
            {
                "variant": variant,
                "accumulator_dtype": dtype_name(acc_dtype),
                "addend_dtype": dtype_name(addend_dtype),
                "addend_cast": how,
                "result_dtype": dtype_name(total.dtype),
                "steps": STEPS,
                "addend": ADDEND,
                "value": value,
                "abs_error": abs(value - EXACT_SUM),
                "device": "cpu",
            }
        )
    return rows


def observe_autocast_dtypes(
    device: torch.device,
    autocast_dtype: torch.dtype,
    seed: int = 0,
    batch: int = 4,
    in_features: int = 8,
    out_features: int = 5,
) -> list[dict]:
    """One forward/backward of the ToyModel (float32 parameters) under autocast: per quantity (QUANTITIES) the
    dtype observed (forward hooks, returned tensors, `.grad` after backward) and how it was observed."""
    torch.manual_seed(seed)
    model = ToyModel(in_features, out_features).to(device)
    observed: dict[str, tuple[set[torch.dtype], str]] = {}

    def record(quantity: str, how: str):
        return lambda module, inputs, output: observed.__setitem__(quantity, ({output.dtype}, how))

    hooks = [
        model.fc1.register_forward_hook(record("fc1 output", "forward hook on fc1")),
        model.ln.register_forward_hook(record("layernorm output", "forward hook on ln")),
        model.fc2.register_forward_hook(record("logits", "forward hook on fc2 (model output)")),
    ]
    x = torch.randn(batch, in_features, device=device)
    targets = torch.randint(0, out_features, (batch,), device=device)
    with torch.autocast(device.type, dtype=autocast_dtype):
        observed["parameters"] = ({p.dtype for p in model.parameters()}, "inspection inside autocast")
        loss = F.cross_entropy(model(x), targets)
    observed["loss"] = ({loss.dtype}, "returned tensor")
    loss.backward()
    observed["gradients"] = ({p.grad.dtype for p in model.parameters()}, ".grad after backward")
    for hook in hooks:
        hook.remove()
    return [
        {
            "device": device.type,
            "autocast_dtype": dtype_name(autocast_dtype),
            "quantity": quantity,
            "dtype": ",".join(sorted(dtype_name(d) for d in observed[quantity][0])),
            "observed_by": observed[quantity][1],
        }
        for quantity in QUANTITIES
    ]
