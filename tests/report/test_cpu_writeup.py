"""Issue 41: what the writeup says of a run without a GPU, on made-up tables written on this (CPU) machine: our
kernels' interpreted checks where the FlashAttention sections would say "needs CUDA", §9 without `nan` and without
judging the one-GPU goals, §1.1.3 without a CUDA call."""

import json
import re
from pathlib import Path

import pandas as pd

from cs336_systems.measure.provenance import write_rows
from cs336_systems.report.context import Context, NotRun
from cs336_systems.report.sections import e2e, flash, flash_peers, train_step

NAN = float("nan")


def context(tmp_path: Path) -> Context:
    return Context(run="t", results=tmp_path / "results", out_dir=tmp_path / "report")


def check_rows(causal=True, dtype="float32", batch=1, heads=1, failed_backward=False):
    """The flash benchmark's rows without CUDA: our kernels' forward and backward checked, per cell."""
    tolerance = 1e-5 if dtype == "float32" else 3e-2
    return [
        {"impl": "triton", "dtype": dtype, "seq_len": n, "d_head": d, "batch_size": batch, "heads": heads,
         "causal": causal, "ms": NAN, "interpreted": True, "pass": p,
         "status": "mismatch" if failed_backward and p == "backward" and n == 256 else "ok",
         "rel_err": (5e-5 if failed_backward and p == "backward" and n == 256 else 2e-7 * (1 + (p == "backward"))),
         "tolerance": tolerance, "reference": "SDPA in float64 on the same inputs", "max_abs_diff_vs_sdpa": 2.4e-7}
        for d in (16, 32)
        for n in (128, 256)
        for p in ("forward", "backward")
    ]  # fmt: skip


def skipped(path: Path, columns: dict) -> None:
    write_rows([{**columns, "status": "skipped", "reason": "needs CUDA"}], path, {"module": "x"})


def test_the_benchmark_grid_shows_our_interpreted_checks(tmp_path):
    write_rows(check_rows(), tmp_path / "results/flash/benchmark_float32_d16.csv", {"seq_lens": [128, 256]})
    skipped(tmp_path / "results/leaderboard/leaderboard.csv", {"impl": "triton", "pass": "forward"})
    text = flash.render(context(tmp_path))
    assert "**Triton interpreter, CPU: correctness only, no timings.**" in text
    assert "needs CUDA" not in text and "nan" not in text.lower().replace("nanoseconds", "")
    # one row per cell and pass, each error beside its bound; the spec's batch 1 and one head are in the prose
    assert re.search(
        r"\| float32 +\| causal +\| 32 +\| 256 +\| backward +\| 4.0e-07 +\| 1e-05 +\| — +\| pass", text
    )
    assert re.search(
        r"\| float32 +\| causal +\| 16 +\| 128 +\| forward +\| 2.0e-07 +\| 1e-05 +\| 2.4e-07 +\| pass", text
    )
    assert "| batch" not in text
    assert "Every one of the 8 checks is within its bound; the largest relative error is 4.0e-07" in text
    # the leaderboard is a GPU timing: the section says what the CPU run did instead of the rows' reason
    assert (
        "Not measured in this run: the leaderboard is a timing on a GPU, and on this CPU run our kernels"
        in text
    )


def test_a_failed_check_is_named(tmp_path):
    write_rows(check_rows(failed_backward=True), tmp_path / "results/flash/b.csv", {})
    text = flash.render(context(tmp_path))
    assert (
        "2 of the 8 checks fail: float32 d=16 seq=256 backward (mismatch); float32 d=32 seq=256 backward"
        in text
    )
    assert re.search(r"\| 256 +\| backward +\| 5.0e-05 +\| 1e-05 +\| — +\| mismatch", text)


def test_the_comparison_with_pytorchs_attention_shows_our_checks_at_its_shapes(tmp_path):
    params = {"heads": 2, "tokens": 256, "impls": ["triton", "sdpa_cudnn", "sdpa_flash", "flex"]}
    rows = check_rows(causal=False, dtype="bfloat16", batch=2, heads=2)
    write_rows(rows, tmp_path / "results/flash_peers/noncausal_d16.csv", params)
    skipped(tmp_path / "results/flash_ncu/kernels.csv", {"impl": "triton", "kernel": "x"})
    text = flash_peers.render(context(tmp_path))
    assert "**Triton interpreter, CPU: correctness only, no timings.**" in text
    assert "Our kernels at this comparison's shapes (2 heads, batch = 256 tokens / sequence length)" in text
    assert re.search(
        r"\| bfloat16 +\| not causal +\| 16 +\| 128 +\| 2 +\| 2 +\| forward +\| 2.0e-07 +\| 3e-02", text
    )
    assert (
        "What ours is timed against (cuDNN, SDPA flash, FlexAttention) runs on a GPU only: not run here."
        in text
    )
    assert "Not measured in this run: Nsight Compute profiles kernels on an NVIDIA GPU" in text
    assert "needs CUDA" not in text


def test_a_gpu_runs_skipped_rows_keep_their_reason(tmp_path):
    """`off_gpu` replaces the reason only where the provenance says there was no GPU."""
    path = tmp_path / "results/leaderboard/leaderboard.csv"
    write_rows([{"status": "skipped", "reason": "ncu not on the PATH"}], path, {})
    sidecar = path.with_suffix(".json")
    meta = json.loads(sidecar.read_text())
    meta["provenance"].update(device_count=1, device_name="NVIDIA H100")
    sidecar.write_text(json.dumps(meta))
    try:
        context(tmp_path).require("leaderboard", "The leaderboard timing", off_gpu="what the CPU did")
    except NotRun as reason:
        assert "Not measured in this run: ncu not on the PATH." in str(reason)
    else:
        raise AssertionError("skipped rows must raise NotRun")


CELL = {"kind": "cell", "head": "fused", "checkpoint": "selective", "compiled": False, "batch_size": 2,
        "status": "ok", "reason": "", "weights": "float32", "peak_mib": NAN, "mfu": NAN}  # fmt: skip
PARAMS = {"d_model": 64, "d_ff": 96, "num_heads": 4, "vocab_size": 97, "context_length": 32, "batch_size": 2,
          "dtype": "float32", "steps": 2, "num_layers": [1, 2], "stacks": ["plain", "native", "ours"]}  # fmt: skip


def cpu_train_step(tmp_path: Path) -> str:
    """§9 of a CPU run: no allocator peak or MFU; ours (interpreted) far slower than the native stack."""
    rows = [
        CELL
        | {
            "stack": stack,
            "attention": attention,
            "num_layers": layers,
            "step_ms": ms * layers,
            "weights_mib": 0.1 * layers,
            "gradients_mib": 0.1 * layers,
            "optimizer_state_mib": 0.2 * layers,
        }
        for stack, attention, ms in (
            ("plain", "naive", 10.0),
            ("native", "sdpa", 12.0),
            ("ours", "flash_triton", 900.0),
        )
        for layers in (1, 2)
    ]
    rows += [
        {"kind": "fit", "stack": stack, "num_layers": 34, "intercept_ms": 0.0, "per_layer_ms": ms,
         "step_ms": 34 * ms, "mfu": NAN, "status": "extrapolated", "reason": "least squares over depths 1, 2"}
        for stack, ms in (("plain", 10.0), ("native", 12.0), ("ours", 900.0))
    ]  # fmt: skip
    write_rows(pd.DataFrame(rows), tmp_path / "results/train_step/all.csv", PARAMS)
    return train_step.render(context(tmp_path))


def test_the_training_step_on_a_cpu_has_no_nan_and_judges_no_gpu_goal(tmp_path):
    text = cpu_train_step(tmp_path)
    assert not re.search(r"(?<![A-Za-z])[+−-]?nan(?![A-Za-z])", text, re.IGNORECASE), text
    assert "torch.cuda" not in text
    assert "Peak and MFU: none on the CPU" in text
    assert (
        "Our Triton kernels (FlashAttention, the fused head + loss, AdamW), which the stacks named ours run, "
        "execute in the Triton interpreter here" in text
    )
    # the state the cell measured from its tensors, without a peak to split
    assert "**Memory at 2 layers by what holds it.**" in text and "no peak to split here" in text
    assert re.search(r"\| ours +\| 0.20 +\| 0.20 +\| 0.40 +\|", text)
    assert "activations and temporaries (GiB)" not in text
    # the one-GPU goals: named, not judged
    assert "FAIL" not in text and "pass" not in text and "goal (one GPU)" not in text
    assert "are judged on a GPU, not on this CPU run: here our Triton kernels run in the interpreter" in text
    assert "ours's" not in text


def test_e2e_on_a_cpu_says_nothing_was_synchronised(tmp_path):
    rows = [
        {"size": "tiny", "context_length": n, "mode": mode, "step": step, "time_ms": 10.0 + step,
         "status": "ok", "batch_size": 4, "warmup": 5}
        for n in (64, 128)
        for mode in ("forward", "forward_backward", "train_step")
        for step in range(3)
    ]  # fmt: skip
    params = {"size": "tiny", "d_model": 64, "d_ff": 256, "num_layers": 2, "num_heads": 4, "vocab_size": 10000,
              "device": "cpu"}  # fmt: skip
    write_rows(rows, tmp_path / "results/e2e/tiny.csv", params)
    text = e2e.render(context(tmp_path))
    assert "synchronize" not in text and "torch.cuda" not in text
    assert "on the CPU, where an operation has finished when it returns, so nothing is synchronised" in text


def test_checkpointing_on_a_cpu_says_what_saved_and_predicted_count(tmp_path):
    """The smoke run's numbers: one forward of tiny (2 blocks, batch 2, context 64, vocabulary 10,000) saves 9.75 MiB
    without checkpointing, of which 2 × R = 2 × 1.167 MiB in the blocks; the predicted peak is the blocks' alone."""
    from cs336_systems.report.sections import checkpointing

    base = {"size": "tiny", "batch_size": 2, "context_length": 64, "attention": "sdpa", "num_layers": 2,
            "autocast": "none", "status": "ok"}  # fmt: skip
    rows = [base | {"record": "block", "residual_bytes": 1223680.0, "checkpoint_bytes": 32768.0,
                    "grad_bytes_per_block": 262656.0}]  # fmt: skip
    rows += [
        base | {"record": "cell", "policy": policy, "saved_bytes": saved, "median_ms": 40.0,
                "memory_reason": "needs CUDA (torch.cuda.max_memory_allocated)"}
        for policy, saved in (("none", 10228244.0), ("every:1", 7845888.0), ("nested", 7845888.0))
    ]  # fmt: skip
    params = {"size": "tiny", "batch_size": 2, "context_length": 64, "attention": "sdpa", "autocast": ["none"],
              "warmup": 1, "steps": 2, "device": "cpu", "d_model": 64, "d_ff": 256, "num_layers": 2,
              "num_heads": 4, "vocab_size": 10000}  # fmt: skip
    write_rows(pd.DataFrame(rows), tmp_path / "results/checkpointing/none.csv", params)
    text = checkpointing.render(context(tmp_path))
    assert "torch.cuda" not in text
    assert "**Saved for backward and predicted count different things.**" in text
    assert "saved for backward − N × R = 9.75 − 2 × 1.167 = 7.42 MiB lies outside the blocks" in text
    assert "float32 log-softmax, 4.9 MiB, and the LM head's weight" in text
    assert "adds the gradients of up to N − 1 = 1 block(s), 0.25 MiB each" in text
