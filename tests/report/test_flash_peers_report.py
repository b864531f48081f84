"""The FlashAttention comparison's tables on made-up rows whose answers are known."""

import re

import pandas as pd

from cs336_systems.report.sections import flash_peers


def test_flash_peers_throughput_is_read_at_each_longest_sequence():
    rows = [
        {"impl": impl, "causal": causal, "d_head": 64, "seq_len": n, "pass": p, "tflops": tflops}
        for impl, base in (("triton", 100.0), ("sdpa_cudnn", 200.0))
        for causal in (True, False)
        for n in (1024, 4096)
        for p, tflops in (("forward", base + n / 1024), ("backward", base / 2 + n / 1024))
    ]
    text = flash_peers.throughput(pd.DataFrame(rows), "a convention")
    assert "TFLOP/s (a convention)" in text
    lines = [line for line in text.splitlines() if line.startswith("| ")][1:]  # the rows under the header
    assert [line.split("|")[1].strip() for line in lines] == ["causal", "causal", "not causal", "not causal"]
    assert all(" 4096 " in line for line in lines)  # only the longest sequence
    assert re.search(r"\| forward +\| +104 +\| +204 +\|", lines[0])  # ours, then cuDNN
    assert re.search(r"\| backward +\| +54 +\| +104 +\|", lines[1])
