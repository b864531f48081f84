"""Activation checkpointing: every policy gives the gradients of the plain model bitwise, saves less for
backward, recomputes as the model says; bad policies are errors naming the field or the flag; the residual
model's peaks and optimum."""

import dataclasses

import pytest
import torch

from cs336_systems import cli
from cs336_systems.model import checkpointing
from cs336_systems.model.transformer import ModelConfig, TransformerLM

NUM_LAYERS = 4


def config(num_layers: int = NUM_LAYERS, **fields) -> ModelConfig:
    return ModelConfig(
        vocab_size=61, context_length=16, d_model=32, num_layers=num_layers, num_heads=4, d_ff=64, **fields
    )


def model_and_tokens(num_layers: int = NUM_LAYERS, **fields) -> tuple[TransformerLM, torch.Tensor]:
    torch.manual_seed(0)
    return TransformerLM(config(num_layers, **fields)), torch.randint(0, 61, (2, 16))


def with_policy(model: TransformerLM, policy: str) -> TransformerLM:
    model.cfg = dataclasses.replace(model.cfg, checkpoint=policy)
    return model


def gradients(model: TransformerLM, tokens: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.nn.functional.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize(
    "policy",
    ["none", "every:1", "every:2", f"every:{NUM_LAYERS}", "nested", "selective", "selective:attention"],
)
@pytest.mark.parametrize(
    "attention", ["naive", "sdpa"]
)  # the selective policies keep fused attention's outputs
def test_gradients_are_bitwise_those_of_the_plain_model(policy, attention):
    model, tokens = model_and_tokens(attention=attention)
    plain = gradients(with_policy(model, "none"), tokens)
    checkpointed = gradients(with_policy(model, policy), tokens)
    assert all(torch.equal(a, b) for a, b in zip(plain, checkpointed, strict=True))


def test_every_policy_of_the_sweep_is_valid_and_the_sweep_is_complete():
    assert checkpointing.sweep(3) == [
        "none",
        "every:1",
        "every:2",
        "every:3",
        "nested",
        "selective",
        "selective:attention",
    ]
    for policy in checkpointing.sweep(3):
        config(3, checkpoint=policy)


def saved(policy: str, num_layers: int = NUM_LAYERS, attention: str = "naive") -> int:
    model, tokens = model_and_tokens(num_layers, attention=attention)
    return checkpointing.saved_bytes(lambda: with_policy(model, policy)(tokens))


def test_checkpointing_saves_fewer_bytes_for_backward():
    none = saved("none")
    assert saved("every:1") < none
    assert saved("selective") < none
    # After the forward nested holds its two halves' inputs, one level at least as many wherever K <= N/2
    for depth in (4, 8):
        nested = saved("nested", depth)
        assert nested <= min(saved(f"every:{k}", depth) for k in range(1, depth // 2 + 1))
        assert nested < saved("every:1", depth)


def test_selective_keeps_more_than_every_1_and_counts_its_cached_matmuls():
    # selective also keeps each block's matmul outputs, which only the SAC cache holds (no saved-tensor hook)
    assert saved("selective") > saved("every:1")
    # keeping only fused attention's outputs sits between the two
    kept = {
        policy: saved(policy, attention="sdpa") for policy in ("every:1", "selective:attention", "selective")
    }
    assert kept["every:1"] < kept["selective:attention"] < kept["selective"]


def test_saved_bytes_counts_a_storage_once_and_skips_parameters():
    weight = torch.nn.Parameter(torch.ones(8))
    x = torch.ones(8, requires_grad=True)
    # x * weight saves both (weight skipped); (x * weight) * x saves the product and x again (counted once)
    assert checkpointing.saved_bytes(lambda: (x * weight) * x) == 2 * 8 * 4


def block_forwards(model: TransformerLM, tokens: torch.Tensor) -> int:
    calls = []
    hooks = [b.register_forward_pre_hook(lambda *_: calls.append(1)) for b in model.blocks]
    gradients(model, tokens)
    for hook in hooks:
        hook.remove()
    return len(calls)


@pytest.mark.parametrize("num_layers", [1, 3, 5, 8])
@pytest.mark.parametrize("policy", ["none", "every:1", "every:2", "nested"])
def test_forward_evaluations_match_the_blocks_run(policy, num_layers):
    if policy == "every:2" and num_layers < 2:
        pytest.skip("every:2 needs two layers")
    model, tokens = model_and_tokens(num_layers)
    measured = block_forwards(with_policy(model, policy), tokens)
    assert measured == checkpointing.forward_evaluations(policy, num_layers)


def test_nested_compute_is_n_log_n():
    # 2N + (N/2)(log2 N - 1) for powers of two: 32 blocks run 128 block forwards, 4x the plain model
    assert checkpointing.forward_evaluations("nested", 32) == 128
    assert checkpointing.forward_evaluations("every:4", 32) == 64


def test_no_grad_forward_runs_the_blocks_plainly():
    model, tokens = model_and_tokens()
    with torch.no_grad():
        plain = with_policy(model, "none")(tokens)
        assert torch.equal(with_policy(model, "nested")(tokens), plain)


@pytest.mark.parametrize("policy", ["every:0", "every:99", "every:", "every:x", "foo", "Nested"])
def test_bad_policies_name_the_field(policy):
    with pytest.raises(ValueError, match=r"ModelConfig\.checkpoint="):
        config(checkpoint=policy)


def test_flag_is_checked_at_parse_time_against_the_size(capsys):
    p = cli.parser("test")
    cli.add_model_args(p)
    args = p.parse_args(["--out", "x.csv", "--size", "tiny", "--checkpoint", "every:2"])
    assert cli.model_config(args, 32).checkpoint == "every:2"
    assert cli.params(args)["checkpoint"] == "every:2"
    for bad in ("every:3", "foo"):  # tiny has 2 layers
        with pytest.raises(SystemExit):
            p.parse_args(["--out", "x.csv", "--size", "tiny", "--checkpoint", bad])
        assert "ModelConfig.checkpoint=" in capsys.readouterr().err


# The residual model (R per block, c per checkpoint, w gradient bytes per block).


def test_held_bytes_of_each_policy():
    r, c = 10.0, 1.0
    assert checkpointing.held_during_backward("none", 4, r, c) == [10, 20, 30, 40]
    assert checkpointing.held_during_backward("every:1", 4, r, c) == [10, 11, 12, 13]
    # groups {1,2}, {3,4}: block 3 holds group 1's checkpoint and its own residuals
    assert checkpointing.held_during_backward("every:2", 4, r, c) == [10, 20, 11, 21]
    # a shorter last group: {1,2,3}, {4}
    assert checkpointing.held_during_backward("every:3", 4, r, c) == [10, 20, 30, 11]
    # halves {1,2} | {3,4}: block 4 runs backward with both halves' inputs and block 3's held
    assert checkpointing.held_during_backward("nested", 4, r, c) == [10, 11, 11, 12]
    with pytest.raises(ValueError):
        checkpointing.held_during_backward("selective", 4, r, c)


def test_peaks_none_is_n_r_every_1_is_n_checkpoints_nested_is_log_n():
    r, c, n = 100.0, 1.0, 32
    assert checkpointing.predicted_peak("none", n, r, c) == n * r
    assert checkpointing.predicted_peak("every:1", n, r, c) == (n - 1) * c + r
    assert checkpointing.predicted_peak(f"every:{n}", n, r, c) == n * r
    assert checkpointing.predicted_peak("nested", n, r, c) == 5 * c + r  # log2(32) checkpoints
    # the larger half goes first, so the right spine is the deepest: floor(log2 N) checkpoints
    assert [checkpointing.predicted_peak("nested", n, r, c) - r for n in (3, 5, 6, 7, 9)] == [1, 2, 2, 2, 3]


@pytest.mark.parametrize("depth", [4, 8, 16, 32])
def test_nested_peak_is_at_most_the_best_one_level_peak(depth):
    r, c = 30.0, 1.0  # a block's residuals are about 30 block inputs (2.7B, fp32)
    best = min(checkpointing.predicted_peak(f"every:{k}", depth, r, c) for k in range(1, depth + 1))
    assert checkpointing.predicted_peak("nested", depth, r, c) <= best


def test_gradients_move_the_peak_to_the_end_of_backward():
    # with w >= c the last block's backward (all later gradients made) sets every:1's peak
    r, c, w, n = 10.0, 1.0, 2.0, 4
    assert checkpointing.predicted_peak("every:1", n, r, c, w) == r + 3 * w


def test_optimal_k_balances_checkpoints_against_one_group():
    # (N/K - 1) c + K R is smallest near sqrt(N c / R): 16 blocks, R = c -> K = 4, tied with 3, 5, 6 (peak 7)
    peaks = {k: checkpointing.predicted_peak(f"every:{k}", 16, 1.0, 1.0) for k in range(1, 17)}
    assert [k for k, peak in peaks.items() if peak == min(peaks.values())] == [3, 4, 5, 6]
    assert checkpointing.optimal_k(16, 1.0, 1.0) == 3  # the smallest of the ties
    assert checkpointing.optimal_k(32, 40.0, 1.0) == 1  # residuals dominate: one block per checkpoint


# The benchmark CLI and the report's analysis of its rows.


def test_benchmark_cli_rows_on_cpu(tmp_path):
    from cs336_systems.experiments import checkpointing_benchmark as bench
    from cs336_systems.measure.provenance import read_rows

    out = tmp_path / "c.csv"
    bench.main(
        [
            "--size",
            "tiny",
            "--batch-size",
            "2",
            "--context-length",
            "16",
            "--autocast",
            "none",
            "--depths",
            "2",
            "3",
            "--policies",
            "none",
            "every:1",
            "nested",
            "--steps",
            "1",
            "--device",
            "cpu",
            "--out",
            str(out),
        ]
    )
    frame, meta = read_rows(out)
    cells = frame[frame["record"] == "cell"]
    assert len(cells) == 6 and (cells["status"] == "ok").all() and cells["median_ms"].gt(0).all()
    assert cells["forward_backward_peak_mib"].isna().all() if "forward_backward_peak_mib" in cells else True
    assert cells["memory_reason"].str.contains("needs CUDA").all()
    saved = cells.set_index(["num_layers", "policy"])["saved_bytes"]
    assert saved[(3, "every:1")] < saved[(3, "none")]
    blocks = frame[frame["record"] == "block"].set_index("num_layers")
    assert blocks.loc[2, "checkpoint_bytes"] == 2 * 16 * 64 * 4  # batch x context x d_model fp32
    assert blocks.loc[2, "residual_bytes"] > blocks.loc[2, "checkpoint_bytes"]
    assert meta["params"]["policies"] == ["none", "every:1", "nested"]


def test_benchmark_cli_rejects_a_policy_beyond_a_depth(capsys):
    from cs336_systems.experiments import checkpointing_benchmark as bench

    with pytest.raises(SystemExit):
        bench.parse_args(
            [
                "--size",
                "tiny",
                "--context-length",
                "16",
                "--depths",
                "2",
                "4",
                "--policies",
                "every:3",
                "--out",
                "x.csv",
            ]
        )
    assert "--policies at depth 2" in capsys.readouterr().err


def test_counting_saved_bytes_leaves_no_tensor_alive():
    """The count must not keep the forward's graph (a pack hook that returns an output with its own grad_fn makes
    a cycle through C++ that gc cannot free): the benchmark measures one cell after another in one process."""
    import gc

    def live_tensor_bytes() -> int:
        gc.collect()
        return sum(t.numel() * t.element_size() for t in gc.get_objects() if type(t) is torch.Tensor)

    cfg = ModelConfig(vocab_size=50, context_length=16, d_model=32, num_layers=2, num_heads=4, d_ff=64)
    model = TransformerLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (2, cfg.context_length))
    before = live_tensor_bytes()
    assert checkpointing.saved_bytes(lambda: model(tokens).sum()) > 0
    assert live_tensor_bytes() == before


def test_saved_bytes_is_unknown_where_the_selective_policy_cannot_see_its_cached_outputs(monkeypatch):
    class ContextBefore212:  # torch < 2.12 passes no op_output to the policy
        def __init__(self, *, is_recompute, op_output=None):
            self.is_recompute = is_recompute

    monkeypatch.setattr(torch.utils.checkpoint, "SelectiveCheckpointContext", ContextBefore212)
    assert saved("selective") is None
    assert saved("every:1") > 0
