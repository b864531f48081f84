"""Run under torchrun (gloo, CPU) by tests/parallel/test_fsdp.py: our FSDP against single-process training, on every rank.

    python -m torch.distributed.run --standalone --nproc-per-node N tests/workers/fsdp_worker.py CASE

As the assignment's own FSDP tests do: deterministic algorithms, every warning an error, a toy model whose Linear
and Embedding are not torch.nn classes (weight (d_out, d_in) used as x @ W.T, and (vocab, d) indexed by ids).
With FSDP_WORKER_DEVICE=cuda the protocol cases put each rank's model and data on a GPU (still gloo, as the
assignment's test does where a GPU is present, unless FSDP_WORKER_BACKEND=nccl: one GPU per rank).
"""

from __future__ import annotations

import copy
import gc
import math
import os
import sys
import warnings
import weakref

import torch
import torch.distributed as dist
from torch import nn

from cs336_systems import adapters
from cs336_systems.parallel import fsdp as fsdp_module
from cs336_systems.parallel.distributed import all_gather_coalesced, distributed, reduce_scatter_coalesced
from cs336_systems.parallel.fsdp import FullyShardedDataParallel

VOCAB, D, HIDDEN, SEQ = 37, 13, 19, 6  # none divisible by 2, 3 or 4: every shard is padded somewhere
DEVICE = torch.device("cpu")  # the protocol cases' device: main() sets it from FSDP_WORKER_DEVICE


class Linear(nn.Module):  # another package's Linear: not an nn.Linear
    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d_out, d_in) / d_in**0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.einsum("...i,oi->...o", x, self.weight)


class Embedding(nn.Module):
    def __init__(self, vocab: int, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocab, d))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.weight[ids]


class RMSNorm(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-5) * self.weight).to(x.dtype)


class ToyLM(nn.Module):
    """The spec's toy model: Embedding -> RMSNorm -> Linear -> ReLU -> RMSNorm -> Linear -> Linear (head)."""

    def __init__(self):
        super().__init__()
        self.embed = Embedding(VOCAB, D)
        self.norm1 = RMSNorm(D)
        self.up = Linear(D, HIDDEN)
        self.norm2 = RMSNorm(HIDDEN)
        self.down = Linear(HIDDEN, D)
        self.head = Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.up(self.norm1(self.embed(ids)))
        return self.head(self.down(self.norm2(torch.relu(x))))


class ProtocolLM(nn.Module):
    """The assignment's FSDP test model (handout §7): vocabulary 100, d_model 64, d_ff 128."""

    def __init__(self):
        super().__init__()
        self.embedding = Embedding(100, 64)
        self.norm1 = RMSNorm(64)
        self.linear1 = Linear(64, 128)
        self.norm2 = RMSNorm(128)
        self.linear2 = Linear(128, 64)
        self.lm_head = Linear(64, 100)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.linear1(self.norm1(self.embedding(ids))))
        return self.lm_head(self.linear2(self.norm2(x)))


class TorchNNLM(nn.Module):
    """Ordinary torch.nn layers: a float32 LayerNorm before biased Linears (mixed precision must cast the
    Linears' inputs and biases); the toy's odd sizes, so every shard is padded somewhere."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.norm = nn.LayerNorm(D)
        self.up = nn.Linear(D, HIDDEN)
        self.down = nn.Linear(HIDDEN, D)
        self.head = nn.Linear(D, VOCAB)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.down(torch.relu(self.up(self.norm(self.embed(ids))))))


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def batches(steps: int, world: int):
    """The same reshuffled global batches on every rank, and this rank's slice of each."""
    rank, n = dist.get_rank(), 20 if 20 % world == 0 else 21
    g = torch.Generator().manual_seed(1234)
    for _ in range(steps):
        ids, targets = (
            torch.randint(VOCAB, (n, SEQ), generator=g),
            torch.randint(VOCAB, (n, SEQ), generator=g),
        )
        mine = slice(rank * n // world, (rank + 1) * n // world)
        yield (ids, targets), (ids[mine], targets[mine])


OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
}


def assert_fp32_equal(actual: torch.Tensor, expected: torch.Tensor, label: str) -> None:
    """Equal up to the order of float32 additions: a gradient summed over the whole batch in one process and
    the same sum split across ranks (each rank's part, then the all-reduce) round differently, by an ulp or so
    of the largest value (measured: at most 1.3e-7 relative over 3 steps, world 2-4). The bound is 8 ulps; a
    real error (a gradient not averaged, a shard misplaced) is orders of magnitude larger."""
    scale = expected.abs().max().item()
    error = (actual - expected).abs().max().item()
    assert error <= 8 * torch.finfo(torch.float32).eps * scale, (
        f"{label} differs by {error:.3g} (max |x| {scale:.3g})"
    )


def check_gradients(fsdp: FullyShardedDataParallel, label: str) -> None:
    """Every trainable parameter of the wrapped module has a gradient shaped like its data, in float32 (a float32
    model's master weights), and the replicated ones are the same on every rank."""
    for name, p in fsdp.module.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and p.grad.shape == p.data.shape and p.grad.dtype == torch.float32, (
                f"{label}: {name} grad {None if p.grad is None else (tuple(p.grad.shape), p.grad.dtype)}"
            )
    for p in fsdp.replicated:
        everyone = [torch.empty_like(p.grad) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, p.grad)
        assert all(torch.equal(g, p.grad) for g in everyone), (
            f"{label}: replicated gradients differ across ranks"
        )


def power_of_two(world: int) -> bool:
    return world & (world - 1) == 0


def train_against_reference(
    optimizer_name: str,
    freeze: str | None = None,
    steps: int = 3,
    exact: bool = False,
    without_weights: tuple[str, ...] = (),
) -> None:
    """fp32 training equals single-process training: up to the order of additions in the usual mode, to the bit
    in exact mode where each rank's share of the mean loss is exact (a power-of-two world; else see
    test_fsdp.py)."""
    torch.manual_seed(0)
    model = ToyLM()
    if freeze:
        model.get_submodule(freeze).weight.requires_grad_(False)
    reference = copy.deepcopy(model)
    frozen_before = model.get_submodule(freeze).weight.detach().clone() if freeze else None
    unread = [model.get_submodule(name) for name in without_weights]
    fsdp = FullyShardedDataParallel(model, exact=exact, backward_without_weights=unread)
    bitwise = exact and power_of_two(dist.get_world_size())
    optimizer = OPTIMIZERS[optimizer_name](fsdp.parameters())
    reference_optimizer = OPTIMIZERS[optimizer_name]([p for p in reference.parameters() if p.requires_grad])
    for step, ((ids, targets), (my_ids, my_targets)) in enumerate(batches(steps, dist.get_world_size())):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(fsdp(my_ids), my_targets).backward()
        adapters.fsdp_on_after_backward(fsdp, optimizer)
        check_gradients(fsdp, f"{optimizer_name} step {step}")
        optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        loss_fn(reference(ids), targets).backward()
        reference_optimizer.step()
        full = adapters.fsdp_gather_full_params(fsdp)
        expected = dict(reference.named_parameters())
        assert full.keys() == expected.keys(), (full.keys(), expected.keys())
        for name, tensor in full.items():
            assert tensor.shape == expected[name].shape, name
            label = f"{optimizer_name} {'exact' if exact else 'usual'} step {step}: {name}"
            if bitwise:
                assert torch.equal(tensor, expected[name]), f"{label}: not bitwise equal"
            else:
                assert_fp32_equal(tensor, expected[name].detach(), label)
    if freeze:
        assert torch.equal(full[f"{freeze}.weight"], frozen_before), "the frozen weight changed"


def cast_reference_step(master: nn.Module, optimizer, ids, targets, dtype: torch.dtype, loss=loss_fn) -> None:
    """One step of a single process whose Linear/Embedding weights are cast to `dtype` for forward and backward,
    with float32 master weights and gradients."""
    working = copy.deepcopy(master)
    for module in working.modules():
        if isinstance(module, (Linear, Embedding)):
            module.weight = nn.Parameter(module.weight.detach().to(dtype))
    loss(working(ids), targets).backward()
    optimizer.zero_grad(set_to_none=True)
    for (_, p), (_, w) in zip(master.named_parameters(), working.named_parameters(), strict=True):
        p.grad = w.grad.float()
    optimizer.step()


def compute_dtype(dtype: torch.dtype, tolerance: float) -> None:
    torch.manual_seed(0)
    model = ToyLM()
    master = copy.deepcopy(model)
    fsdp = adapters.get_fsdp(model, compute_dtype=dtype)
    # SGD, as the assignment's test: AdamW turns a rounding-sized gradient near zero into a full step of lr
    optimizer = OPTIMIZERS["sgd"](fsdp.parameters())
    reference_optimizer = OPTIMIZERS["sgd"](master.parameters())
    for step, ((ids, targets), (my_ids, my_targets)) in enumerate(batches(3, dist.get_world_size())):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(fsdp(my_ids), my_targets).backward()
        adapters.fsdp_on_after_backward(fsdp, optimizer)
        check_gradients(fsdp, f"{dtype} step {step}")
        optimizer.step()
        cast_reference_step(master, reference_optimizer, ids, targets, dtype)
        full = adapters.fsdp_gather_full_params(fsdp)
        for name, p in master.named_parameters():
            assert full[name].dtype == torch.float32, f"{name}: master weights must stay float32"
            assert torch.allclose(full[name], p.detach(), atol=tolerance, rtol=tolerance), (
                f"{dtype} step {step}: {name} differs by {(full[name] - p).abs().max().item():.3g}"
            )


def check_prefetch_rule(fsdp: FullyShardedDataParallel, forward: list, backward: list) -> None:
    """A unit's all-gather starts only after the unit two before it finished its forward (in the backward: the
    unit two after it finished its backward), and each unit is gathered once in each."""
    order = fsdp.order
    gathers = [i for kind, i in forward if kind == "gather"]
    assert sorted(gathers) == sorted(order), f"each unit gathered once in the forward: {forward}"
    for kind, index in forward:
        position = order.index(index)
        if kind == "gather" and position >= 2:
            done = forward.index(("forward_done", order[position - 2]))
            assert done < forward.index((kind, index)), f"unit {index} gathered too early: {forward}"
    assert sorted(i for kind, i in backward if kind == "gather") == sorted(order), (
        f"one gather each: {backward}"
    )
    for kind, index in backward:
        position = order.index(index)
        if kind == "gather" and position + 2 < len(order):
            done = backward.index(("backward_done", order[position + 2]))
            assert done < backward.index((kind, index)), f"unit {index} gathered too early: {backward}"


def recorded_step(fsdp: FullyShardedDataParallel, ids, targets) -> tuple[list, list]:
    """One forward and backward with events recorded: (forward events, backward events); no gathered weight
    outlives either."""
    fsdp.record_events = True
    fsdp.events.clear()
    logits = fsdp(ids)
    assert not any(w.gathered for w in fsdp.weights), "a gathered weight outlived the forward"
    forward = list(fsdp.events)
    loss_fn(logits, targets).backward()
    fsdp.finish_gradient_synchronization()
    assert not any(w.gathered for w in fsdp.weights), "a gathered weight outlived the backward"
    fsdp.record_events = False
    return forward, fsdp.events[len(forward) :]


def check_one_group_per_unit(fsdp: FullyShardedDataParallel, ids, targets) -> None:
    """Each unit's weights are all-gathered as one group in each pass and reduce-scattered as one group."""
    groups: dict[str, list[int]] = {"all_gather_coalesced": [], "reduce_scatter_coalesced": []}
    originals = {name: getattr(fsdp_module, name) for name in groups}

    def counted(name):
        def call(outputs, *args):
            groups[name].append(len(outputs))
            return originals[name](outputs, *args)

        return call

    for name in groups:
        setattr(fsdp_module, name, counted(name))
    try:
        recorded_step(fsdp, ids, targets)
    finally:
        for name, original in originals.items():
            setattr(fsdp_module, name, original)
    per_unit = sorted(len(indices) for _, indices in fsdp.units)
    assert sorted(groups["all_gather_coalesced"]) == sorted(per_unit * 2), groups
    assert sorted(groups["reduce_scatter_coalesced"]) == per_unit, groups


def prefetch_rule() -> None:
    torch.manual_seed(0)
    fsdp = FullyShardedDataParallel(ToyLM())
    (ids, targets), (my_ids, my_targets) = next(batches(1, dist.get_world_size()))
    for _ in range(2):  # the second step prefetches by the order the first one recorded
        forward, backward = recorded_step(fsdp, my_ids, my_targets)
    assert [fsdp.weights[i].name for i in fsdp.order] == [
        "embed.weight",
        "up.weight",
        "down.weight",
        "head.weight",
    ]
    check_prefetch_rule(fsdp, forward, backward)
    # the counted waits: one per gathered weight in each pass, each under the pass that waited
    fsdp.measure_communication = True
    loss_fn(fsdp(my_ids), my_targets).backward()
    fsdp.finish_gradient_synchronization()
    record = fsdp.last_communication
    assert [phase for phase, _ in record.gather_waits] == ["forward"] * 4 + ["backward"] * 4, (
        record.gather_waits
    )
    stats = record.stats()
    split = stats["gather_wait_forward_s"] + stats["gather_wait_backward_s"]
    assert stats["gather_wait_s"] == split and min(stats.values()) >= 0, stats


def backward_without_weights() -> None:
    """A unit whose backward reads no weights (the embedding: its gradient comes from the ids) is gathered for the
    forward only: training equals single-process training, its weight is never gathered in the backward (the other
    units' prefetch rule unchanged), and a step all-gathers its bytes once, not twice. What is no unit, and exact
    mode, are refused."""
    train_against_reference("adamw", without_weights=("embed",))
    torch.manual_seed(0)
    (_, _), (my_ids, my_targets) = next(batches(1, dist.get_world_size()))
    moved = {}
    for unread in ((), ("embed",)):
        model = ToyLM()
        fsdp = FullyShardedDataParallel(
            model, backward_without_weights=[model.get_submodule(n) for n in unread]
        )
        for _ in range(2):
            forward, backward = recorded_step(fsdp, my_ids, my_targets)
        embed = next(u for u, (module, _) in enumerate(fsdp.units) if module is model.embed)
        assert ("gather", embed) in forward and (("gather", embed) in backward) == (not unread), backward
        assert sorted(i for kind, i in backward if kind == "gather") == sorted(
            set(fsdp.order) - {embed} if unread else fsdp.order
        )
        fsdp.measure_communication = True
        loss_fn(fsdp(my_ids), my_targets).backward()
        fsdp.finish_gradient_synchronization()
        moved[unread] = fsdp.last_communication.bytes_moved["bytes_all_gathered"]
    world = dist.get_world_size()
    embed_bytes = (world - 1) * math.ceil(VOCAB * D / world) * 4
    assert moved[()] - moved[("embed",)] == embed_bytes, (moved, embed_bytes)
    model = ToyLM()
    for unread, exact, match in ((model.norm1, False, "not units"), (model.embed, True, "exact mode")):
        try:
            FullyShardedDataParallel(model, exact=exact, backward_without_weights=[unread])
        except ValueError as error:
            assert "backward_without_weights" in str(error) and match in str(error), error
        else:
            raise AssertionError(f"backward_without_weights={unread} with exact={exact} was accepted")


def block_units(exact: bool = False) -> None:
    """Transformer blocks as units (as the leaderboard's train step shards its compiled blocks): fp32 training
    equals single-process training, a block's weights are gathered together, and the prefetch rule holds by
    unit. In exact mode (each block over the whole batch, the final norm its own call) it equals it to the bit at
    a power-of-two world size (else up to the order of additions: the per-rank mean)."""
    from cs336_systems.model.transformer import ModelConfig, TransformerLM

    cfg = ModelConfig.from_name("tiny", vocab_size=61, context_length=8)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    reference = copy.deepcopy(model)
    fsdp = FullyShardedDataParallel(model, units=model.blocks, exact=exact)
    assert [unit for unit, _ in fsdp.units] == [model.embedding, *model.blocks, model.lm_head], fsdp.units
    assert all(len(indices) == 5 for _, indices in fsdp.units[1:-1]), "qkv, out, w1, w2, w3 per block"
    assert not exact or fsdp.replicated_modules == [model.final_norm], fsdp.replicated_modules
    # SGD: AdamW turns a rounding-sized gradient difference near zero into a step of lr (as compute_dtype says)
    optimizer = OPTIMIZERS["sgd"](fsdp.parameters())
    reference_optimizer = OPTIMIZERS["sgd"](reference.parameters())
    world, rank = dist.get_world_size(), dist.get_rank()
    label = "exact blocks" if exact else "block units"
    g = torch.Generator().manual_seed(7)
    for step in range(3):
        ids = torch.randint(61, (4 * world, 8), generator=g)
        mine = ids[rank * 4 : (rank + 1) * 4]
        optimizer.zero_grad(set_to_none=True)
        forward, backward = recorded_step(fsdp, mine[:, :-1], mine[:, 1:])
        check_gradients(fsdp, f"{label} step {step}")
        optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        loss_fn(reference(ids[:, :-1]), ids[:, 1:]).backward()
        reference_optimizer.step()
        full = fsdp.gather_full_params()
        for name, p in reference.named_parameters():
            if exact and power_of_two(world):
                assert torch.equal(full[name], p), f"{label} step {step}: {name} not bitwise equal"
            else:
                assert_fp32_equal(full[name], p.detach(), f"{label} step {step}: {name}")
    check_prefetch_rule(fsdp, forward, backward)
    if world > 1 and not exact:  # exact mode reduces nothing
        check_one_group_per_unit(fsdp, mine[:, :-1], mine[:, 1:])
    try:
        FullyShardedDataParallel(copy.deepcopy(reference), units=[model.blocks[0]])
    except ValueError as error:
        assert "units[0]" in str(error), error
    else:
        raise AssertionError("a unit outside the wrapped module was accepted")


class PartlyUsed(nn.Module):
    """A unit one of whose layers the forward never calls, so its weight gets no gradient."""

    def __init__(self):
        super().__init__()
        self.used, self.spare = Linear(D, D), Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def partly_used_unit() -> None:
    """A unit whose backward never produces all its weight gradients: those it produced are still reduced (at the
    synchronisation), and match single-process training's; the unused weight gets none."""
    torch.manual_seed(0)
    model = nn.Sequential(Embedding(VOCAB, D), PartlyUsed(), Linear(D, VOCAB))
    reference = copy.deepcopy(model)
    fsdp = FullyShardedDataParallel(model, units=[model[1]])
    (ids, targets), (my_ids, my_targets) = next(batches(1, dist.get_world_size()))
    loss_fn(fsdp(my_ids), my_targets).backward()
    fsdp.finish_gradient_synchronization()
    loss_fn(reference(ids), targets).backward()
    assert model[1].spare.weight.grad is None, "the unused weight got a gradient"
    for weight in fsdp.weights:
        if weight.name == "1.spare.weight":
            continue
        expected = reference.get_parameter(weight.name).grad.reshape(-1)
        expected = torch.nn.functional.pad(expected, (0, weight.shard_numel * weight.world - weight.numel))
        assert_fp32_equal(weight.shard.grad, weight.own_chunk(expected), f"partly used unit: {weight.name}")


def meta_device() -> None:
    """Our TransformerLM built on the meta device, its blocks as units, sharded onto the CPU and set one top-level
    child at a time from cs336_systems.model.transformer.initial_values: its gathered weights and its buffers are
    the model's built whole from the same seed, to the bit, in float32 and in bf16; the run's RNG is left where the
    whole build leaves it. A meta module without `device` is refused."""
    from cs336_systems.model.transformer import ModelConfig, TransformerLM, initial_values

    cfg = ModelConfig.from_name("tiny", vocab_size=61, context_length=8)
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(3)
        reference = TransformerLM(cfg).to(dtype)
        after_reference = torch.rand(4)
        torch.manual_seed(3)
        with torch.device("meta"):
            model = TransformerLM(cfg).to(dtype)
        values = initial_values(model, torch.device("cpu"))
        fsdp = FullyShardedDataParallel(model, units=model.blocks, device=torch.device("cpu"))
        assert all(w.shard.numel() == w.shard_numel for w in fsdp.weights), "shards only"
        for owner, name, value in values:
            fsdp.set_full_value(owner, name, value)
        assert torch.equal(torch.rand(4), after_reference), "the run's RNG moved on as the whole build's"
        full = fsdp.gather_full_params()
        for name, p in reference.named_parameters():
            assert full[name].dtype == dtype and torch.equal(full[name], p), f"meta {dtype}: {name} differs"
        buffers = dict(model.named_buffers())
        for name, b in reference.named_buffers():
            assert torch.equal(buffers[name], b), f"meta {dtype}: buffer {name} differs"
    with torch.device("meta"):
        model = TransformerLM(cfg)
    try:
        FullyShardedDataParallel(model)
    except ValueError as error:
        assert "meta device needs `device`" in str(error), error
    else:
        raise AssertionError("a module on the meta device was wrapped without a device")


def bf16_weights() -> None:
    """A bf16 model (the leaderboard's storage): shards, gradients and so the optimizer's state stay bf16, and
    training matches single-process bf16 training up to bf16 rounding of the reduction."""
    torch.manual_seed(0)
    model = ToyLM().to(torch.bfloat16)
    reference = copy.deepcopy(model)
    fsdp = FullyShardedDataParallel(model)
    optimizer = OPTIMIZERS["sgd"](fsdp.parameters())
    reference_optimizer = OPTIMIZERS["sgd"](reference.parameters())
    for step, ((ids, targets), (my_ids, my_targets)) in enumerate(batches(3, dist.get_world_size())):
        optimizer.zero_grad(set_to_none=True)
        loss_fn(fsdp(my_ids), my_targets).backward()
        fsdp.finish_gradient_synchronization()
        assert all(p.grad.dtype == torch.bfloat16 for p in fsdp.parameters()), "gradients must stay bf16"
        optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        loss_fn(reference(ids), targets).backward()
        reference_optimizer.step()
        full = fsdp.gather_full_params()
        for name, p in reference.named_parameters():
            assert full[name].dtype == torch.bfloat16, f"{name}: stored as {full[name].dtype}"
            error = (full[name].float() - p.float()).abs().max().item()
            assert error <= 2e-2 * p.float().abs().max().item(), (
                f"bf16 step {step}: {name} differs by {error:.3g}"
            )


def our_transformer() -> None:
    from cs336_systems.model.transformer import ModelConfig, TransformerLM

    cfg = ModelConfig.from_name("tiny", vocab_size=61, context_length=8)
    torch.manual_seed(0)
    model = TransformerLM(cfg)
    reference = copy.deepcopy(model)
    fsdp = FullyShardedDataParallel(model)
    sharded = {w.name for w in fsdp.weights}
    assert (
        "embedding.weight" in sharded and "lm_head.weight" in sharded and "blocks.0.ffn.w1.weight" in sharded
    ), sharded
    optimizer = OPTIMIZERS["sgd"](fsdp.parameters())
    reference_optimizer = OPTIMIZERS["sgd"](reference.parameters())
    world, rank = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(7)
    for step in range(2):
        ids = torch.randint(61, (4 * world, 8), generator=g)
        mine = ids[rank * 4 : (rank + 1) * 4]
        optimizer.zero_grad(set_to_none=True)
        loss_fn(fsdp(mine[:, :-1]), mine[:, 1:]).backward()
        fsdp.finish_gradient_synchronization()
        optimizer.step()
        reference_optimizer.zero_grad(set_to_none=True)
        loss_fn(reference(ids[:, :-1]), ids[:, 1:]).backward()
        reference_optimizer.step()
        full = fsdp.gather_full_params()
        for name, p in reference.named_parameters():
            assert_fp32_equal(full[name], p.detach(), f"TransformerLM step {step}: {name}")


def exact_refusals() -> None:
    """What exact mode cannot make exact is refused with the reason: a module that holds replicated parameters
    and also contains sharded layers (its parameters' gradients need its whole forward over the whole batch,
    units included), and activation checkpointing (its recomputation runs units again inside the backward)."""
    from cs336_systems.model.transformer import ModelConfig, TransformerLM

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.ones(()))
            self.inner = ToyLM()

        def forward(self, ids):
            return self.inner(ids) * self.scale

    try:
        FullyShardedDataParallel(Scaled(), exact=True)
    except ValueError as error:
        assert "the wrapped module (Scaled) holds replicated parameters and contains sharded layers" in str(
            error
        )
    else:
        raise AssertionError("exact mode accepted a module with replicated parameters around sharded layers")
    FullyShardedDataParallel(Scaled())  # the usual mode all-reduces that gradient: nothing to refuse

    cfg = ModelConfig.from_name("tiny", vocab_size=61, context_length=8, checkpoint="every:1")
    fsdp = FullyShardedDataParallel(TransformerLM(cfg), exact=True)
    ids = torch.randint(61, (2, 8))
    try:
        loss_fn(fsdp(ids[:, :-1]), ids[:, 1:]).backward()
    except RuntimeError as error:
        assert "exact mode does not support activation checkpointing" in str(error), error
    else:
        raise AssertionError("exact mode ran under activation checkpointing")


def anomaly_mode() -> None:
    """The assignment's own FSDP test turns anomaly detection on before its backward: fp32 and fp16 training must
    still match single-process training under it."""
    torch.autograd.set_detect_anomaly(True, check_nan=False)
    try:
        train_against_reference("sgd", steps=2)
        protocol("sgd")  # exact mode, whose backward runs the units again inside the backward
        compute_dtype(torch.float16, 1e-4)
    finally:
        torch.autograd.set_detect_anomaly(False)


def tied() -> None:
    model = ToyLM()
    model.head.weight = model.embed.weight
    try:
        FullyShardedDataParallel(model)
    except ValueError as error:
        assert "head.weight and embed.weight" in str(error) or "embed.weight" in str(error), error
    else:
        raise AssertionError("a tied weight was sharded")


def protocol_batches(world: int, steps: int):
    """The protocol's data on every rank: 20 sequences of 8 tokens (21 where 20 does not split evenly) and one
    label each, reshuffled between steps; yields the whole batch and this rank's share."""
    rank, n = dist.get_rank(), 20 if 20 % world == 0 else 21
    torch.manual_seed(123)
    ids, labels = torch.randint(0, 100, (n, 8)), torch.randint(0, 100, (n,))
    for step in range(steps):
        mine = slice(rank * n // world, (rank + 1) * n // world)
        yield (ids.to(DEVICE), labels.to(DEVICE)), (ids[mine].to(DEVICE), labels[mine].to(DEVICE))
        torch.manual_seed(42 + step)
        order = torch.randperm(n)
        ids, labels = ids[order], labels[order]


def last_position_loss(
    logits: torch.Tensor, labels: torch.Tensor, global_batch: int | None = None
) -> torch.Tensor:
    """Cross-entropy on the last position: the mean over these sequences, or with `global_batch` their sum over
    the whole batch's size."""
    last = logits[:, -1, :].float()
    if global_batch is None:
        return nn.functional.cross_entropy(last, labels)
    return nn.functional.cross_entropy(last, labels, reduction="sum") / global_batch


def protocol(optimizer_name: str, dtype: torch.dtype | None = None, tolerance: float = 0.0) -> None:
    """The assignment's FSDP test (handout §7, ADDENDUM-2026.md), three steps: after each, every parameter
    gathered and compared with single-process training on the whole batch: bitwise in fp32 (through the adapter,
    which takes our exact mode), within `tolerance` with a compute dtype (against a process that casts its
    Linear and Embedding weights for forward and backward). Where the world size is not a power of two the
    per-rank mean cannot be exact (test_fsdp.py shows why): in fp32 there each rank's loss is its sum over the
    whole batch's size, and the wrapper sums (gradient_divide_factor=1)."""
    world = dist.get_world_size()
    summed = dtype is None and not power_of_two(world)
    optimizers = {
        "sgd": lambda params: torch.optim.SGD(params, lr=0.01),
        "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2),
    }
    torch.manual_seed(42)
    base = ProtocolLM().to(DEVICE)
    reference = copy.deepcopy(base)
    if summed:
        fsdp = FullyShardedDataParallel(copy.deepcopy(base), exact=True, gradient_divide_factor=1)
    else:
        fsdp = adapters.get_fsdp(copy.deepcopy(base), compute_dtype=dtype)
    optimizer, reference_optimizer = (
        optimizers[optimizer_name](fsdp.parameters()),
        optimizers[optimizer_name](reference.parameters()),
    )
    label = f"protocol {optimizer_name} {dtype or 'fp32'} on {world} ranks"
    for step, ((ids, labels), (my_ids, my_labels)) in enumerate(protocol_batches(world, 3)):
        optimizer.zero_grad(set_to_none=True)
        last_position_loss(fsdp(my_ids), my_labels, len(ids) if summed else None).backward()
        adapters.fsdp_on_after_backward(fsdp, optimizer)
        check_gradients(fsdp, f"{label} step {step}")
        optimizer.step()
        if dtype is None:
            reference_optimizer.zero_grad(set_to_none=True)
            last_position_loss(reference(ids), labels).backward()
            reference_optimizer.step()
        else:
            cast_reference_step(reference, reference_optimizer, ids, labels, dtype, last_position_loss)
        full = adapters.fsdp_gather_full_params(fsdp)
        for name, p in reference.named_parameters():
            assert full[name].dtype == torch.float32, f"{label}: {name} stored as {full[name].dtype}"
            if dtype is None:
                assert torch.equal(full[name], p.detach()), (
                    f"{label} step {step}: {name} differs by {(full[name] - p).abs().max().item():.3g}"
                )
            else:
                assert torch.allclose(full[name], p.detach(), atol=tolerance, rtol=tolerance), (
                    f"{label} step {step}: {name} differs by {(full[name] - p).abs().max().item():.3g}"
                )


def exact_where_the_reduce_scatter_averages() -> None:
    """Exact mode reduces nothing, so its gradients are divided after whatever the reduce-scatter's op: here the
    op NCCL gets (AVG) while the ranks run on gloo, where that path is otherwise never taken (a refactor that
    skipped the division wherever the op was AVG passed on gloo and failed over NCCL)."""

    def averaging(backend: str, divide_factor: float, world: int) -> dist.ReduceOp:
        return dist.ReduceOp.AVG

    original, fsdp_module.reduce_op_for = fsdp_module.reduce_op_for, averaging
    try:
        protocol("sgd")
        train_against_reference("adamw", exact=True)
    finally:
        fsdp_module.reduce_op_for = original


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def torch_nn_bf16() -> None:
    """Ordinary torch.nn layers (a float32 LayerNorm, biased Linears) under bf16 compute with AdamW train as one
    process does under bf16 autocast on the whole batch. The first step's gradients (the same weights on both
    sides) agree to bf16 rounding; AdamW then moves every weight by about lr whatever its gradient's size, so a
    gradient that rounding flips near zero becomes a full step the other way: the weights' changes over three
    steps agree to 25 % (measured: at most 9.5 % at world 2 to 4; a gradient not averaged, a bias not cast, a shard misplaced: the first check)."""
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    model = TorchNNLM().to(DEVICE)
    reference = copy.deepcopy(model)
    initial = {name: p.detach().clone() for name, p in model.named_parameters()}
    fsdp = FullyShardedDataParallel(model, compute_dtype=torch.bfloat16)
    norm_inputs = []  # the LayerNorm, replicated, runs in float32 (CUDA's layer_norm refuses bf16 with fp32 weights)
    model.norm.register_forward_pre_hook(lambda _, args: norm_inputs.append(args[0].dtype))
    optimizer = torch.optim.AdamW(fsdp.parameters(), lr=1e-3)
    reference_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    n = 4 * world
    for step in range(3):
        ids, targets = (torch.randint(VOCAB, (n, SEQ), generator=g).to(DEVICE) for _ in range(2))
        mine = slice(rank * 4, (rank + 1) * 4)
        optimizer.zero_grad(set_to_none=True)
        logits = fsdp(ids[mine])
        assert logits.dtype == torch.bfloat16, logits.dtype
        loss = loss_fn(logits, targets[mine])
        loss.backward()
        fsdp.finish_gradient_synchronization()
        check_gradients(fsdp, f"torch.nn bf16 step {step}")
        reference_optimizer.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE.type, dtype=torch.bfloat16):
            reference_loss = loss_fn(reference(ids), targets)
        reference_loss.backward()
        dist.all_reduce(loss := loss.detach().clone())
        assert abs(loss.item() / world - reference_loss.item()) <= 1e-2 * reference_loss.item(), (
            f"torch.nn bf16 step {step}: loss {loss.item() / world} against {reference_loss.item()}"
        )
        if step == 0:
            expected = {name: p.grad for name, p in reference.named_parameters()}
            for weight in fsdp.weights:  # a shard's gradient against its chunk of the whole gradient
                whole = torch.zeros(weight.shard_numel * world, device=DEVICE)
                whole[: weight.numel] = expected.pop(weight.name).reshape(-1)
                expected[weight.name] = weight.own_chunk(whole)
            for name, p in fsdp.module.named_parameters():
                error = relative_error(p.grad, expected[name])
                assert error <= 3e-2, f"torch.nn bf16: {name}'s gradient differs by {error:.3g} (relative)"
        optimizer.step()
        reference_optimizer.step()
    assert norm_inputs == [torch.float32] * 3, f"the LayerNorm's inputs were {norm_inputs}"
    full = fsdp.gather_full_params()
    for name, p in reference.named_parameters():
        assert full[name].dtype == torch.float32, f"{name}: master weights must stay float32"
        error = relative_error(full[name] - initial[name], p.detach() - initial[name])
        assert error <= 0.25, (
            f"torch.nn bf16: {name}'s change over 3 AdamW steps differs by {error:.3g} (relative)"
        )


def grouped_collectives_hold_their_tensors() -> None:
    """A started group of collectives keeps its tensors alive until wait() returns, though the caller drops them
    (as FSDP drops a unit's padded gradients once their reduce-scatter starts), whatever the backend keeps."""
    world, rank, n = dist.get_world_size(), dist.get_rank(), 1000
    for start, in_size, out_size in (
        (reduce_scatter_coalesced, world * n, n),
        (all_gather_coalesced, n, world * n),
    ):
        inputs = [torch.full((in_size,), float(rank + 1)) for _ in range(3)]
        outputs = [torch.empty(out_size) for _ in range(3)]
        refs = [weakref.ref(t) for t in inputs]
        options = {"op": dist.ReduceOp.SUM} if start is reduce_scatter_coalesced else {}
        work = start(outputs, inputs, **options)
        del inputs
        gc.collect()
        assert all(ref() is not None for ref in refs), f"{start.__name__}: inputs freed before the wait"
        work.wait()
        del work
        gc.collect()
        assert all(ref() is None for ref in refs), f"{start.__name__}: inputs outlived their collectives"
        if start is reduce_scatter_coalesced:
            expected = [torch.full((n,), world * (world + 1) / 2)] * 3
        else:
            expected = [torch.arange(1, world + 1).float().repeat_interleave(n)] * 3
        for out, exp in zip(outputs, expected, strict=True):
            torch.testing.assert_close(out, exp, rtol=0, atol=0)


def gloo_collectives_go_alone() -> None:
    """On gloo a group is its collectives one by one, never c10d's coalescing manager (gloo's coalesced all-gather
    corrupts the heap now and then: distributed._grouped)."""
    assert dist.get_backend() == "gloo", dist.get_backend()
    c10d, world = dist.distributed_c10d, dist.get_world_size()
    manager, c10d._coalescing_manager = c10d._coalescing_manager, None  # calling it now raises TypeError
    gathered = [torch.empty(3 * world, dtype=torch.bfloat16), torch.empty(world)]
    reduced = [torch.empty(2)]
    try:
        all_gather_coalesced(gathered, [torch.ones(3, dtype=torch.bfloat16), torch.ones(1)]).wait()
        reduce_scatter_coalesced(reduced, [torch.ones(2 * world)], dist.ReduceOp.SUM).wait()
    finally:
        c10d._coalescing_manager = manager
    assert all(bool((out == 1).all()) for out in gathered), gathered
    assert bool((reduced[0] == world).all()), reduced


CASES = {
    "equality": lambda: [
        train_against_reference(name, exact=exact) for name in OPTIMIZERS for exact in (False, True)
    ],
    "frozen": lambda: train_against_reference("adamw", freeze="down"),
    "compute_dtype": lambda: (compute_dtype(torch.float16, 1e-4), compute_dtype(torch.bfloat16, 1e-3)),
    "prefetch": prefetch_rule,
    "without_weights": backward_without_weights,
    "units": block_units,
    "partly_used": partly_used_unit,
    "bf16": bf16_weights,
    "meta": meta_device,
    "transformer": our_transformer,
    "tied": tied,
    "anomaly": anomaly_mode,
    "protocol": lambda: [protocol(name) for name in ("sgd", "adamw")],
    "protocol_low_precision": lambda: (
        protocol("sgd", torch.float16, 1e-4),
        protocol("sgd", torch.bfloat16, 1e-4),
    ),
    "torch_nn_bf16": torch_nn_bf16,
    "exact_transformer": lambda: block_units(exact=True),
    "exact_refusals": exact_refusals,
    "exact_averaging": exact_where_the_reduce_scatter_averages,
    "lifetime": grouped_collectives_hold_their_tensors,
    "gloo_alone": gloo_collectives_go_alone,
}


def main() -> None:
    global DEVICE
    if os.environ.get("FSDP_WORKER_DEVICE") == "cuda":
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        torch.cuda.set_device(DEVICE)
    warnings.simplefilter("error")
    torch.use_deterministic_algorithms(True)
    with distributed(backend=os.environ.get("FSDP_WORKER_BACKEND", "gloo"), timeout_s=600):
        for case in sys.argv[1:]:
            CASES[case]()
            # every rank through the case before it is reported: a test reads its own cases' lines
            dist.barrier()
            if dist.get_rank() == 0:
                print(f"FSDP case {case} OK on {dist.get_world_size()} ranks", flush=True)
        if dist.get_rank() == 0:
            print(f"FSDP {' '.join(sys.argv[1:])} OK on {dist.get_world_size()} ranks", flush=True)


if __name__ == "__main__":
    main()
