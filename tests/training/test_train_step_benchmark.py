"""The leaderboard's training step (cs336_systems.training.stacks): every stack trains the same model to
the same result as the plain one, and the CLI writes its cells and the per-layer fit. On the CPU in float32, with
our Triton kernels in the interpreter (set before anything imports triton; a fresh process where it came too
late, as in tests/kernels/test_fused_cross_entropy.py)."""

import os
import sys

TRITON_PREIMPORTED = "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"
os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import contextlib  # noqa: E402
import dataclasses  # noqa: E402
import functools  # noqa: E402
import subprocess  # noqa: E402
import types  # noqa: E402
from pathlib import Path  # noqa: E402

import pandas as pd  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from torch.utils.checkpoint import create_selective_checkpoint_contexts  # noqa: E402

from cs336_systems.experiments import train_step_benchmark, train_step_check  # noqa: E402
from cs336_systems.model import checkpointing  # noqa: E402
from cs336_systems.training.stacks import STACKS, build_step, model_flops  # noqa: E402

from ..fresh_process import assert_passes_in_fresh_process  # noqa: E402

launches_kernels = pytest.mark.skipif(
    TRITON_PREIMPORTED, reason="triton was imported before TRITON_INTERPRET=1: run in a fresh process instead"
)
# Odd vocabulary and context, d_head 16 (our FlashAttention's smallest).
DIMS = {"d_model": 64, "d_ff": 96, "num_layers": 2, "num_heads": 4, "vocab_size": 97, "context_length": 19}


def one_step(stack: str) -> tuple[float, dict, dict]:
    """Loss, gradients and updated weights of one step from the same weights and batch (batch 2, float32)."""
    train = build_step(
        STACKS[stack], DIMS, 2, torch.device("cpu"), torch.float32, compile_blocks=False, head_chunk=16
    )
    train.optimizer.zero_grad(set_to_none=True)
    loss = train.loss()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in train.model.named_parameters()}
    train.optimizer.step()
    return loss.item(), grads, {n: p.detach().clone() for n, p in train.model.named_parameters()}


@launches_kernels
@pytest.mark.parametrize("stack", [s for s in STACKS if s != "plain" and STACKS[s].sharding == "none"])
def test_every_stack_trains_as_the_plain_model(stack: str):
    loss, grads, weights = one_step("plain")
    their_loss, their_grads, their_weights = one_step(stack)
    # float32 throughout; what differs is the order of the sums (flash's online softmax, chunked and fused heads,
    # recomputed activations), so the results agree to float32 rounding, not bitwise.
    assert their_loss == pytest.approx(loss, rel=1e-5)
    for name, grad in grads.items():
        torch.testing.assert_close(their_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(their_weights[name], weights[name], rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("stack", "compiled"),
    [("plain_fsdp", False), ("native_fsdp", False), ("ours_fsdp", False), ("ours_fsdp", True),
     ("ours_fsdp_chunked_head", False), ("ours_fsdp_torch_adamw", False)],
)  # fmt: skip
def test_sharded_stacks_train_as_the_unsharded_ones(stack: str, compiled: bool):
    """Two ranks (gloo), each on its own sequence, against the same stack unsharded on both sequences
    (tests/workers/train_step_worker.py): the initial weights and buffers (the sharded model built on the meta
    device) equal to the bit, then summed loss and updated full weights. Compiled: our FSDP's hooks stay outside
    the compiled blocks, the units."""
    run_train_step_worker(2, stack, *(["--compile"] if compiled else []))


@pytest.mark.parametrize("stack", ["native_fsdp", "ours_fsdp"])
def test_sharded_stacks_start_from_the_plain_models_weights_on_three_ranks(stack: str):
    """Three ranks: every weight's shards padded somewhere; the initial weights alone."""
    run_train_step_worker(3, stack, "--initial-only")


def run_train_step_worker(nproc: int, *args: str) -> None:
    worker = Path(__file__).parents[1].joinpath("workers", "train_step_worker.py")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc)]
    result = subprocess.run(
        [*command, str(worker), *args], capture_output=True, text=True, timeout=600, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"OK on {nproc} ranks" in result.stdout


@launches_kernels
def test_twenty_steps_give_the_plain_models_loss_curve():
    """Training, not one step: 20 AdamW steps on a fixed batch (the loss falls) by each of the main stacks."""
    curves = {}
    for stack in ("plain", "native", "ours"):
        train = build_step(
            STACKS[stack],
            {**DIMS, "num_layers": 1},
            2,
            torch.device("cpu"),
            torch.float32,
            compile_blocks=False,
            head_chunk=16,
        )
        curves[stack] = torch.stack([train.train_step() for _ in range(20)])
    assert curves["plain"][-1] < 0.95 * curves["plain"][0]  # lr 1e-4: it learns, slowly
    for stack in ("native", "ours"):
        torch.testing.assert_close(curves[stack], curves["plain"], rtol=1e-4, atol=0, msg=stack)


@launches_kernels
@pytest.mark.parametrize("stack", ["native", "ours"])
def test_compiled_checkpointed_blocks_compute_what_eager_ones_do(stack: str):
    """torch.compile traces each block with its selective checkpoint (`_CheckpointedBlock`)."""
    steps = [
        build_step(
            STACKS[stack], DIMS, 2, torch.device("cpu"), torch.float32, compile_blocks=compiled, head_chunk=16
        )
        for compiled in (True, False)
    ]
    losses = []
    for train in steps:
        losses.append(train.loss())
        losses[-1].backward()
    assert losses[0].item() == pytest.approx(losses[1].item(), rel=1e-6)
    for (name, p), q in zip(steps[1].model.named_parameters(), steps[0].model.parameters(), strict=True):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)


@launches_kernels
def test_a_compiled_block_keeps_the_rotation_in_place_of_the_projection(monkeypatch: pytest.MonkeyPatch):
    """Selective checkpointing in a compiled block keeps our RoPE's output (q, k and v in one tensor): the rotation
    runs once a step, not again in backward, and the blocks save as many bytes as when the QKV projection's output
    was kept in its place (the policy without RoPE's op, patched in)."""

    def saved_and_rotations() -> tuple[int | None, int]:
        torch._dynamo.reset()
        train = build_step(
            STACKS["ours"], DIMS, 2, torch.device("cpu"), torch.float32, compile_blocks=True, head_chunk=16
        )
        train.loss().backward()  # compiles
        saved = checkpointing.saved_bytes(train.loss)
        with torch.profiler.profile() as prof:
            train.loss().backward()
        return saved, sum(event.name == checkpointing.ROPE_OP for event in prof.events())

    saved, rotations = saved_and_rotations()
    without_rope = checkpointing.SELECTIVE["selective"] - {checkpointing.ROPE_OP}
    policy = functools.partial(checkpointing._keep, without_rope)
    monkeypatch.setitem(
        checkpointing._SELECTIVE_CONTEXTS,
        "selective",
        functools.partial(create_selective_checkpoint_contexts, policy),
    )
    saved_recomputing, rotations_recomputing = saved_and_rotations()
    assert (rotations, rotations_recomputing) == (DIMS["num_layers"], 2 * DIMS["num_layers"])
    assert saved is not None and saved == saved_recomputing


@launches_kernels
def test_float32_master_weights_keep_the_updates_bf16_weights_lose():
    """ours_fp32_master in a bf16 run: float32 weights, gradients and AdamW state, the loss of the float32 model up to
    bf16 compute, and every weight moved by a step, where the bf16 norm weights of ours (all 1.0, spacing 2^-7
    there) lose their update of about the learning rate."""
    fp32_loss = one_step("plain")[0]
    moved = {}
    for stack in ("ours", "ours_fp32_master"):
        train = build_step(
            STACKS[stack], DIMS, 2, torch.device("cpu"), torch.bfloat16, compile_blocks=False, head_chunk=16
        )
        before = {n: p.detach().clone() for n, p in train.model.named_parameters()}
        loss = train.train_step()
        moved[stack] = {
            n: (p.detach() != before[n]).float().mean().item() for n, p in train.model.named_parameters()
        }
        if stack == "ours_fp32_master":
            assert {p.dtype for p in train.model.parameters()} == {torch.float32}
            assert {p.grad.dtype for p in train.model.parameters()} == {torch.float32}
            assert loss.item() == pytest.approx(fp32_loss, rel=2e-3)
    norms = [n for n in moved["ours"] if "norm" in n]
    assert norms and all(moved["ours"][n] == 0 for n in norms)
    assert all(fraction == 1 for fraction in moved["ours_fp32_master"].values())


def test_model_flops_is_the_handouts_formula():
    dims = {"d_model": 4096, "d_ff": 11_008, "vocab_size": 151_936}
    per_layer = 6 * 32_768 * (4 * 4096**2 + 3 * 4096 * 11_008) + 6 * 32_768**2 * 4096
    head = 6 * 32_768 * 4096 * 151_936
    assert model_flops(dims, 34, 32_768, 1) == 34 * per_layer + head
    assert model_flops(dims, 34, 32_768, 1) == pytest.approx(2.37e15, rel=5e-3)  # the 2.37 PFLOP
    assert model_flops(dims, 2, 32_768, 2) == 2 * model_flops(dims, 2, 32_768, 1)


@launches_kernels
def test_cli_writes_cells_and_the_per_layer_fit(tmp_path: Path):
    out = tmp_path / "steps.csv"
    train_step_benchmark.main(
        [
            "--out",
            str(out),
            "--d-model",
            "32",
            "--d-ff",
            "48",
            "--num-heads",
            "2",
            "--vocab-size",
            "61",
            "--context-length",
            "16",
            "--num-layers",
            "1",
            "2",
            "--batch-size",
            "2",
            "--stacks",
            "plain",
            "ours",
            "--dtype",
            "float32",
            "--no-compile",
            "--steps",
            "1",
            "--extrapolate-layers",
            "34",
            "--head-chunk",
            "fused=5",  # 32 tokens: six chunks of 5 and one of 2
        ]
    )
    rows = pd.read_csv(out)
    cells, fits = rows[rows["kind"] == "cell"], rows[rows["kind"] == "fit"].set_index("stack")
    assert len(cells) == 4 and (cells["status"] == "ok").all() and (cells["step_ms"] > 0).all()
    # each cell names its head's chunk; the plain model's eager head has none
    assert cells.set_index("stack")["head_chunk"].loc["ours"].tolist() == [5, 5]
    assert cells.set_index("stack")["head_chunk"].loc["plain"].isna().all()
    assert (cells["weights"] == "float32").all()
    assert cells[["build_peak_mib", "first_step_peak_mib", "peak_mib"]].isna().all().all()  # no CUDA peaks
    assert (cells["updated_fraction"] == 1).all()  # float32 weights keep every update, weight decay's too
    # float32 weights and gradients of the same size, AdamW's two moments twice that (and our kernel's step counts
    # are Python numbers); the deeper model holds more
    assert (cells["gradients_mib"] == cells["weights_mib"]).all()
    assert ((cells["optimizer_state_mib"] - 2 * cells["weights_mib"]).abs() < 1e-3).all()
    assert (
        cells.set_index(["stack", "num_layers"])["weights_mib"].loc[("ours", 2)]
        > cells.set_index(["stack", "num_layers"])["weights_mib"].loc[("ours", 1)]
    )
    for stack, ran in cells.groupby("stack"):
        two, one = ran.set_index("num_layers")["step_ms"].loc[[2, 1]]
        assert fits.loc[stack, "per_layer_ms"] == pytest.approx(two - one)
        assert fits.loc[stack, "step_ms"] == pytest.approx(one + 33 * (two - one))
        assert fits.loc[stack, "status"] == "extrapolated" and "34 layers" in fits.loc[stack, "reason"]


class FakeAllocator:
    """The CUDA allocator's peak statistics as measure() reads them: what is allocated now and the peak since the
    last reset (a reset starts the peak from what is allocated)."""

    def __init__(self):
        self.now = self.peak = 0.0

    def hold(self, mib: float, transient: float) -> None:
        self.now += mib
        self.peak = max(self.peak, self.now + transient)

    def reset(self, device: torch.device) -> None:
        self.peak = self.now

    def read(self, device: torch.device) -> float:
        return self.peak


def test_the_steps_peak_is_not_the_builds(monkeypatch):
    """A cell whose build keeps 10 MiB but passes through 100 MiB more (a whole model before its shards), whose
    first step keeps 20 MiB more (gradients, optimizer state) with 50 MiB of temporaries (compilation), and whose
    later steps need 5 MiB of temporaries: the build's peak is 110 MiB, the first step's 80 and the step's own 35,
    not the 110 a peak since the build would say."""
    from cs336_systems.bench import stack_timing

    fake, steps = FakeAllocator(), []
    build_step = stack_timing.build_step

    def build(*args, **kwargs):
        train = build_step(*args, **kwargs)
        fake.hold(10, transient=100)
        step = train.train_step

        def allocating_step():
            fake.hold(0 if steps else 20, transient=5 if steps else 50)
            steps.append(fake.peak)
            return step()

        train.train_step = allocating_step
        return train

    monkeypatch.setattr(stack_timing, "build_step", build)
    monkeypatch.setattr(stack_timing, "reset_peak", fake.reset)
    monkeypatch.setattr(stack_timing, "peak_mib", fake.read)
    args = train_step_benchmark.parse_args(
        ["--out", "unused.csv", "--d-model", "32", "--d-ff", "48", "--num-heads", "2", "--vocab-size", "61",
         "--context-length", "16", "--num-layers", "1", "--stacks", "plain", "--dtype", "float32",
         "--no-compile", "--steps", "2", "--warmup-steps", "1"]
    )  # fmt: skip
    result = stack_timing.measure("plain", 1, args, torch.device("cpu"), 0.0)
    assert len(steps) >= 4  # the first, one warm-up and two timed (then the ones after the peaks are read)
    assert (result["build_peak_mib"], result["first_step_peak_mib"], result["peak_mib"]) == (110, 80, 35)


def test_time_budgets_become_step_counts_every_rank_shares(monkeypatch):
    """On several ranks `--time-budgets` turns do_bench's warm-up and repetition times into step counts from the
    slowest rank's step, the same on every rank (an all-reduce of the maximum); without it the fixed counts run."""
    import torch.distributed as dist

    from cs336_systems.bench import stack_timing

    runs = []

    def this_rank(step, warmup, steps, device):  # 100 ms a step here
        runs.append((warmup, steps))
        return [0.1] * steps

    def slowest_rank(tensor, op):  # another rank takes 250 ms a step
        assert op == dist.ReduceOp.MAX
        tensor.clamp_(min=0.25)

    monkeypatch.setattr(stack_timing, "time_steps", this_rank)
    ranks = types.SimpleNamespace(
        is_initialized=lambda: True, all_reduce=slowest_rank, ReduceOp=dist.ReduceOp
    )
    monkeypatch.setattr(stack_timing, "dist", ranks)
    args = argparse.Namespace(time_budgets=True, warmup_ms=1000, rep_ms=3000, warmup_steps=1, steps=3)
    ms, counts = stack_timing.time_step(lambda: None, torch.device("cpu"), args)
    assert counts == {"warmup_steps": 4, "timed_steps": 12}  # 1,000 / 250 and 3,000 / 250
    assert runs == [(0, 1), (4, 0), (0, 12)] and ms == 250.0  # the estimate, the warm-up, the timed steps
    runs.clear()
    ms, counts = stack_timing.time_step(
        lambda: None, torch.device("cpu"), argparse.Namespace(**{**vars(args), "time_budgets": False})
    )
    assert counts == {"warmup_steps": 1, "timed_steps": 3} and runs == [(1, 0), (0, 3)]
    assert stack_timing.budget_steps(5000.0, 1000, 3000) == (
        1,
        1,
    )  # a step longer than both budgets: one each


@launches_kernels
def test_cli_clocks_each_cell_from_empty_caches(tmp_path: Path, monkeypatch):
    """--cold-cache: Inductor and Triton write into a new folder, gone after the run (torch's fresh_cache), and
    every cell says how long its build, first step and the run up to its timing's end took."""
    import torch._inductor.utils

    seen = []
    fresh_cache = torch._inductor.utils.fresh_cache

    def watched_fresh_cache():
        with fresh_cache():
            seen.append(os.environ["TORCHINDUCTOR_CACHE_DIR"])
            assert os.listdir(seen[-1]) == []  # empty when the run starts
            yield

    monkeypatch.setattr(torch._inductor.utils, "fresh_cache", contextlib.contextmanager(watched_fresh_cache))
    out = tmp_path / "cold.csv"
    train_step_benchmark.main(
        [
            "--out",
            str(out),
            "--d-model",
            "32",
            "--d-ff",
            "48",
            "--num-heads",
            "2",
            "--vocab-size",
            "61",
            "--context-length",
            "16",
            "--num-layers",
            "1",
            "2",
            "--batch-size",
            "2",
            "--stacks",
            "ours",
            "--dtype",
            "float32",
            "--no-compile",
            "--steps",
            "1",
            "--cold-cache",
            "--device",
            "cpu",
        ]
    )
    assert len(seen) == 1 and not os.path.exists(seen[0])
    assert os.environ.get("TORCHINDUCTOR_CACHE_DIR") != seen[0]
    rows = pd.read_csv(out)
    cells = rows[rows["kind"] == "cell"].set_index("num_layers")
    assert (cells[["build_s", "first_step_s"]] > 0).all().all()
    # the run's clock keeps going from cell to cell, past each one's build and first step
    assert (
        cells.loc[2, "elapsed_s"]
        > cells.loc[1, "elapsed_s"] + cells.loc[2, "build_s"] + cells.loc[2, "first_step_s"]
    )
    assert rows.loc[rows["kind"] == "fit", ["build_s", "first_step_s", "elapsed_s"]].isna().all().all()


def test_components_and_kernels_split_a_profiled_step(tmp_path: Path):
    out = tmp_path / "parts.csv"
    train_step_benchmark.main(
        [
            "--out",
            str(out),
            "--d-model",
            "32",
            "--d-ff",
            "48",
            "--num-heads",
            "2",
            "--vocab-size",
            "61",
            "--context-length",
            "16",
            "--num-layers",
            "2",
            "--batch-size",
            "2",
            "--stacks",
            "native",
            "--dtype",
            "float32",
            "--no-compile",
            "--steps",
            "1",
            "--components",
            "--kernels",
            "--device",
            "cpu",
        ]
    )
    rows = pd.read_csv(out)
    kernels = rows[rows["kind"] == "kernel"]
    # the same profiled step, kernel by kernel: its kernels add up to its components
    assert kernels["kernel_ms"].sum() == pytest.approx(
        rows.loc[rows["kind"] == "component", "component_ms"].sum()
    )
    assert (kernels["calls"] > 0).all() and kernels["kernel"].is_unique
    assert set(kernels["component"]) <= {
        "attention",
        "head + loss",
        "optimizer",
        "matmul",
        "elementwise and other",
    }
    parts = rows[rows["kind"] == "component"].set_index("component")["component_ms"]
    assert set(parts.index) == {"attention", "head + loss", "optimizer", "matmul", "elementwise and other"}
    # (the CPU's AdamW runs per-tensor aten ops, mul_ and the like, which count as "other" here)
    assert (parts[["attention", "head + loss", "matmul", "elementwise and other"]] > 0).all(), parts


def test_kernels_are_sorted_into_components():
    from cs336_systems.training.stacks import component_of

    assert component_of("flash_bwd_dkdv_kernel") == "attention"
    assert component_of("cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16") == "attention"
    assert component_of("_cross_entropy_rows_kernel") == "head + loss"
    assert component_of("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>") == "optimizer"
    assert component_of("nvjet_sm90_tst_320x128_64x3_1x2_h_bz_coopB_TNT") == "matmul"
    assert component_of("triton_poi_fused_mul_silu_0") == "elementwise and other"


def test_head_chunks_are_set_for_every_head_or_per_head(capsys: pytest.CaptureFixture):
    args = ["--num-layers", "1", "--out", "x.csv"]
    parse = lambda *chunks: train_step_benchmark.parse_args([*args, "--head-chunk", *chunks])
    assert parse("4096").head_chunk == {"chunked": 4096, "fused": 4096}
    assert parse("fused=8192", "chunked=2048").head_chunk == {"chunked": 2048, "fused": 8192}
    # a named head over the bare value
    assert parse("fused=8192", "1024").head_chunk == {"chunked": 1024, "fused": 8192}
    assert train_step_benchmark.parse_args(args).head_chunk == {"chunked": 8192, "fused": 8192}
    for bad, says in [
        (["fused=1", "fused=2"], "--head-chunk sets each head once: got fused fused"),
        (["eager=4"], "'eager' is not a chunked head (one of chunked, fused)"),
        (["fused=0"], "must be >= 1, got 0"),
    ]:
        with pytest.raises(SystemExit):
            parse(*bad)
        assert says in capsys.readouterr().err


def test_bad_dimensions_are_refused_before_any_work(tmp_path: Path, capsys: pytest.CaptureFixture):
    with pytest.raises(SystemExit):
        train_step_benchmark.main(
            ["--out", str(tmp_path / "x.csv"), "--d-model", "30", "--num-heads", "4", "--num-layers", "1"]
        )
    assert "--d-model 30 must split into --num-heads 4 heads" in capsys.readouterr().err


@launches_kernels
def test_check_cli_passes_correct_stacks_and_fails_a_wrong_one(tmp_path: Path, monkeypatch):
    """train_step_check on the CPU in float32: native and ours pass every check against the float32 plain model;
    a stack whose optimizer steps ten times too far passes the loss and gradients and fails the weights."""
    args = [
        "--d-model",
        "64",
        "--d-ff",
        "96",
        "--num-heads",
        "4",
        "--vocab-size",
        "97",
        "--context-length",
        "19",
        "--steps",
        "3",
        "--dtype",
        "float32",
        "--no-compile",
        "--device",
        "cpu",
    ]
    train_step_check.main([*args, "--stacks", "native", "ours", "--out", str(tmp_path / "ok.csv")])
    rows = pd.read_csv(tmp_path / "ok.csv")
    assert set(rows["quantity"]) == {"loss", "gradients", "weights", "loss_curve"} and len(rows) == 8
    assert rows["passed"].all() and (rows["yardstick"] == 0).all() and (rows["error"] < 1e-5).all()

    broken = dataclasses.replace(STACKS["ours"])
    monkeypatch.setitem(train_step_check.STACKS, "ours", broken)
    original = train_step_check.build_step

    def far_step(stack, *a, **k):
        built = original(stack, *a, **k)
        if stack is broken:
            for group in built.optimizer.param_groups:
                group["lr"] *= 10
        return built

    monkeypatch.setattr(train_step_check, "build_step", far_step)
    train_step_check.main([*args, "--stacks", "ours", "--out", str(tmp_path / "bad.csv")])
    passed = pd.read_csv(tmp_path / "bad.csv").set_index("quantity")["passed"]
    assert passed["loss"] and passed["gradients"] and not passed["weights"] and not passed["loss_curve"]


@pytest.mark.skipif(not TRITON_PREIMPORTED, reason="the kernel tests ran in this process")
def test_kernel_tests_in_fresh_process():
    assert_passes_in_fresh_process(__file__)
