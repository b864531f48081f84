"""cs336_systems.bench.attention_timing: the attention variants, their inputs and the timed backward passes."""

import pytest
import torch

from cs336_systems.bench import attention_timing
from cs336_systems.model.transformer import naive_attention


def test_time_backward_times_each_pass_after_an_untimed_forward():
    calls = []

    def attend(q, k, v):
        calls.append(q.grad)  # the gradients are reset before every forward
        return naive_attention(q, k, v)

    inputs, grad_out = attention_timing.random_inputs(2, 8, 4, torch.float32, torch.device("cpu"))
    assert [x.shape for x in inputs] == [(2, 8, 4)] * 3 and all(x.requires_grad for x in inputs)
    times, memory = attention_timing.time_backward(attend, inputs, grad_out, 2, 3, torch.device("cpu"))
    assert len(times) == 3 and all(t > 0 for t in times)
    assert len(calls) == 5 and all(grad is None for grad in calls)
    assert all(x.grad is not None for x in inputs)
    assert memory == {"mem_before_backward_mib": None, "peak_forward_mib": None, "peak_backward_mib": None}


def test_attention_variants():
    assert attention_timing.attention_variant("eager") is naive_attention
    with pytest.raises(ValueError, match="variant 'flash'"):
        attention_timing.attention_variant("flash")
