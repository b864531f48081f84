"""cs336_systems.bench.precision: the accumulation loops and the autocast dtypes, as library calls."""

import torch

from cs336_systems.bench import precision


def test_accumulate_adds_in_the_accumulator_dtype():
    total = precision.accumulate(torch.float32, torch.float16, cast_to_acc=True)
    addend = torch.tensor(0.01, dtype=torch.float16).float()
    expected = torch.tensor(0.0)
    for _ in range(precision.STEPS):
        expected += addend
    assert total.dtype == torch.float32 and total.item() == expected.item()
    assert precision.accumulate(torch.float16, torch.float16, cast_to_acc=False).dtype == torch.float16


def test_autocast_dtypes_come_in_the_question_order_with_how_they_were_observed():
    rows = precision.observe_autocast_dtypes(torch.device("cpu"), torch.bfloat16)
    assert [row["quantity"] for row in rows] == list(precision.QUANTITIES)
    assert {row["autocast_dtype"] for row in rows} == {"bfloat16"}
    by_quantity = {row["quantity"]: row for row in rows}
    assert by_quantity["fc1 output"]["dtype"] == "bfloat16" and by_quantity["gradients"]["dtype"] == "float32"
    assert by_quantity["gradients"]["observed_by"] == ".grad after backward"
