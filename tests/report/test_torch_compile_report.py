"""The torch.compile (b) section on a made-up run whose answers are known: speedups, compile cost, pay-back, OOM."""

import pandas as pd

from cs336_systems.report.analysis import paired_speedups
from cs336_systems.report.formatting import speedup_table
from cs336_systems.report.sections import torch_compile

LAYERS = {"shallow": (2, 64), "deep": (8, 32)}  # size: (num_layers, d_model)


def rows(size, context, mode, compiled, first_ms, step_ms, steps=3):
    base = {
        "size": size,
        "context_length": context,
        "batch_size": 4,
        "mode": mode,
        "warmup": 2,
        "compile": compiled,
    }
    if step_ms is None:
        return [{**base, "first_step_ms": None, "step": None, "time_ms": None, "status": "OOM"}]
    return [
        {**base, "first_step_ms": first_ms, "step": i, "time_ms": step_ms, "status": "ok"}
        for i in range(steps)
    ]


def meta(size):
    layers, d_model = LAYERS[size]
    return {"params": {"size": size, "num_layers": layers, "d_model": d_model, "d_ff": 4 * d_model}}


FRAME = pd.DataFrame(
    # shallow: compiling costs 5 s (forward) and saves 5 ms a step, so it pays back after 1,000 steps.
    rows("shallow", 64, "forward", False, 100.0, 10.0)
    + rows("shallow", 64, "forward", True, 5100.0, 5.0)
    + rows("shallow", 64, "train_step", False, 200.0, 40.0)
    + rows("shallow", 64, "train_step", True, 8200.0, 20.0)
    # deep: 20 s and 50 s to compile; its train step runs out of memory in eager only.
    + rows("deep", 64, "forward", False, 100.0, 30.0)
    + rows("deep", 64, "forward", True, 20100.0, 20.0)
    + rows("deep", 64, "train_step", False, None, None)
    + rows("deep", 64, "train_step", True, 50200.0, 90.0)
)
METAS = [meta("shallow"), meta("deep")]


def test_compile_cost_and_pay_back_come_from_the_first_and_timed_steps():
    text = torch_compile.compile_cost(torch_compile.step_times(FRAME), METAS)
    table = pd.DataFrame(
        [line.strip("|").split("|") for line in text.splitlines() if line.startswith("|")][2:]
    ).map(str.strip)
    table.columns = ["size", "layers", "mode", "cost", "pay back"]
    got = {(r["size"], r["mode"]): (r["cost"], r["pay back"]) for _, r in table.iterrows()}
    assert got == {
        ("shallow", "forward"): ("5", "1,000"),
        ("deep", "forward"): ("20", "2,000"),
        ("shallow", "train step (AdamW)"): ("8", "400"),
    }  # deep's train step has no eager time to compare with
    assert "Forward: compiling costs 5–20 s" in text
    assert "The widest model, shallow (d_model 64, 2 layers), compiles faster than the deepest, deep" in text


def test_speedups_extremes_and_out_of_memory_sentences():
    compared = paired_speedups(FRAME, "compile", "False", "True", ["size", "context_length", "mode"])
    table = speedup_table(compared, ["shallow", "deep"], torch_compile.LABELS)
    cells = torch_compile.step_times(FRAME)
    assert torch_compile.speedups(cells).to_dict() == {  # deep's train step: eager ran out of memory
        ("forward", "deep", 64): 1.5,
        ("forward", "shallow", 64): 2.0,
        ("train step (AdamW)", "shallow", 64): 2.0,
    }
    assert "largest for shallow's forward at context 64 (2.00×) and smallest for deep's forward" in (
        torch_compile.extremes(cells)
    )
    assert (
        torch_compile.out_of_memory(table)
        == "Only eager runs out of memory for deep's train step (AdamW) at context 64."
    )


def test_a_run_without_first_step_times_shows_no_cost():
    assert (
        torch_compile.compile_cost(torch_compile.step_times(FRAME.drop(columns="first_step_ms")), METAS) == ""
    )
