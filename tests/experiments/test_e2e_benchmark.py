"""The end-to-end benchmark CLI on CPU: tidy rows per timed step, provenance, OOM rows, flag errors."""

import json

import pandas as pd
import pytest
import torch

from cs336_systems.experiments import e2e_benchmark

TINY = ["--size", "tiny", "--batch-size", "2"]


def test_writes_one_row_per_timed_step_with_provenance(tmp_path):
    out = tmp_path / "e2e.csv"
    e2e_benchmark.main(
        [*TINY, "--context-lengths", "16", "32", "--warmup", "1", "--steps", "3", "--out", str(out)]
    )
    rows = pd.read_csv(out)
    assert len(rows) == 2 * 3 * 3  # contexts x modes x steps
    assert set(rows["mode"]) == {"forward", "forward_backward", "train_step"}
    assert (rows["status"] == "ok").all() and (rows["time_ms"] > 0).all()
    assert sorted(rows["step"].unique()) == [0, 1, 2]
    # The first warm-up step, timed on its own: one value per cell, on every row of it.
    firsts = rows.groupby(["context_length", "mode"])["first_step_ms"]
    assert (firsts.nunique() == 1).all() and (rows["first_step_ms"] > 0).all()
    meta = json.loads(out.with_suffix(".json").read_text())
    assert meta["params"]["context_lengths"] == [16, 32] and meta["rows"] == 18
    assert meta["provenance"]["torch"] == torch.__version__


def test_without_warmup_the_first_step_is_a_timed_one(tmp_path):
    out = tmp_path / "e2e.csv"
    flags = "--context-lengths 8 --modes forward --warmup 0 --steps 2 --out".split()
    e2e_benchmark.main([*TINY, *flags, str(out)])
    rows = pd.read_csv(out)
    assert len(rows) == 2 and rows["first_step_ms"].isna().all()


def test_each_compiled_cell_compiles_afresh_for_its_one_shape(tmp_path, monkeypatch):
    """Three context lengths in one process, with a recompile limit of one: each compiles its own graph, with
    static shapes (no automatic dynamic shapes carried over from the previous cell, no eager fallback)."""
    graphs = []

    def capture(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda model, **kwargs: compile_(model, backend=capture, **kwargs))
    out = tmp_path / "compiled.csv"
    flags = "--context-lengths 8 12 16 --modes forward --warmup 1 --steps 1 --compile --out".split()
    with torch._dynamo.config.patch(recompile_limit=1):  # (monkeypatch would delete the key on undo)
        e2e_benchmark.main([*TINY, *flags, str(out)])
    assert (pd.read_csv(out)["status"] == "ok").all()
    shapes = []
    for graph in graphs:
        inputs = [n.meta["example_value"] for n in graph.graph.nodes if n.op == "placeholder"]
        assert not any(isinstance(v, torch.SymInt) for v in inputs), "a dynamic-shape graph"
        shapes.append(next(v.shape for v in inputs if v.dtype == torch.long))  # the token ids
    assert shapes == [(2, 8), (2, 12), (2, 16)]


def test_train_step_changes_parameters_and_forward_does_not():
    from cs336_systems.model.transformer import ModelConfig
    from cs336_systems.training import workload

    cfg = ModelConfig(vocab_size=50, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    model, optimizer = workload.build(cfg, torch.device("cpu"))
    batch = workload.random_batch(cfg, 2, torch.device("cpu"))
    before = [p.detach().clone() for p in model.parameters()]
    step = workload.TrainingStep(model, optimizer, batch)
    step.mode("forward")()
    step.mode("forward_backward")()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())  # forward_backward frees its gradients
    step.mode("train_step")()
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_a_training_step_synchronises_gradients_between_backward_and_the_optimizer():
    from cs336_systems.model.transformer import ModelConfig
    from cs336_systems.training import workload

    cfg = ModelConfig(vocab_size=50, context_length=8, d_model=16, num_layers=1, num_heads=2, d_ff=32)
    model, optimizer = workload.build(cfg, torch.device("cpu"))
    seen = []
    step = workload.TrainingStep(
        model,
        optimizer,
        workload.random_batch(cfg, 2, torch.device("cpu")),
        sync_gradients=lambda: seen.append([p.grad.clone() for p in model.parameters()]),
    )
    before = [p.detach().clone() for p in model.parameters()]
    step.train_step()
    assert len(seen) == 1 and all(g.abs().sum() > 0 for g in seen[0][:1])  # gradients exist at the hook
    assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    with pytest.raises(ValueError, match="needs an optimizer"):
        workload.TrainingStep(model, None, step.batch).mode("train_step")


def test_out_of_memory_becomes_an_oom_row(tmp_path, monkeypatch):
    def no_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")

    monkeypatch.setattr(e2e_benchmark.workload, "build", no_memory)
    out = tmp_path / "oom.csv"
    e2e_benchmark.main(
        [*TINY, "--context-lengths", "16", "--modes", "forward", "--steps", "2", "--out", str(out)]
    )
    rows = pd.read_csv(out)
    assert rows["status"].tolist() == ["OOM"] and rows["time_ms"].isna().all()


def test_other_errors_are_not_swallowed(tmp_path, monkeypatch):
    monkeypatch.setattr(e2e_benchmark.workload, "build", lambda *a, **k: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        e2e_benchmark.main([*TINY, "--context-lengths", "16", "--out", str(tmp_path / "x.csv")])


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", "0"], "argument --steps: must be >= 1"),
        (["--warmup", "-1"], "argument --warmup: must be >= 0"),
        (["--context-lengths", "0"], "argument --context-lengths: must be >= 1"),
        (["--batch-size", "two"], "argument --batch-size: 'two' is not an integer"),
        (["--size", "huge"], "argument --size: invalid choice: 'huge'"),
        (["--device", "gpu0"], "argument --device: 'gpu0' is not a device"),
    ],
)
def test_bad_flags_fail_before_any_work(tmp_path, capsys, flags, message):
    args = [*TINY, "--context-lengths", "16", "--out", str(tmp_path / "x.csv")]
    with pytest.raises(SystemExit):
        e2e_benchmark.main(args + flags)
    assert message in capsys.readouterr().err
    assert not (tmp_path / "x.csv").exists()


@pytest.mark.parametrize(
    "cli",
    [
        "e2e_benchmark",
        "memory_profile",
        "profile_model",
        "ddp_benchmark",
        "sharding_benchmark",
        "fsdp_benchmark",
    ],
)
def test_every_model_cli_takes_a_size_by_name(cli, tmp_path, capsys):
    """Every CLI that builds the Transformer names its model by size (one table: cs336_systems.model.sizes)."""
    import importlib

    module = importlib.import_module(f"cs336_systems.experiments.{cli}")
    with pytest.raises(SystemExit):
        module.parse_args(["--size", "huge", "--out", str(tmp_path / "x.csv")])
    assert "argument --size: invalid choice: 'huge'" in capsys.readouterr().err


def test_cuda_without_a_gpu_is_an_error(tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit):
        e2e_benchmark.main(
            [*TINY, "--context-lengths", "16", "--device", "cuda", "--out", str(tmp_path / "x.csv")]
        )
    assert "argument --device: 'cuda': CUDA is not available" in capsys.readouterr().err


def test_or_oom_turns_only_out_of_memory_into_a_marker():
    from cs336_systems.measure.timing import or_oom

    def no_memory():
        raise torch.OutOfMemoryError("CUDA out of memory")

    assert or_oom(lambda: (1, [2])) == (1, [2])
    assert or_oom(no_memory) == "OOM"
    with pytest.raises(ZeroDivisionError):
        or_oom(lambda: 1 / 0)


def test_provenance_names_the_commit_given_by_the_environment(monkeypatch):
    """A tree copied to a GPU machine may carry a stale .git; the commit it was sent at wins."""
    from cs336_systems.measure import provenance

    monkeypatch.setenv("CS336_GIT_COMMIT", "0123abc")
    assert provenance.collect()["git_commit"] == "0123abc"
    monkeypatch.delenv("CS336_GIT_COMMIT")
    assert provenance.collect()["git_commit"] != "0123abc"


def test_a_sweep_cell_gives_its_rows_or_its_oom_rows_and_frees_memory(monkeypatch, capsys):
    from cs336_systems.measure import timing

    freed = []
    monkeypatch.setattr(timing, "free_memory", lambda: freed.append(True))

    def no_memory():
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore")

    assert timing.rows_or_oom("t", "cell 1", lambda: [{"a": 1}], lambda: [{"a": "OOM"}]) == [{"a": 1}]
    assert timing.rows_or_oom("t", "cell 2", no_memory, lambda: [{"a": "OOM"}]) == [{"a": "OOM"}]
    with pytest.raises(ZeroDivisionError):
        timing.rows_or_oom("t", "cell 3", lambda: 1 / 0, lambda: [])
    assert freed == [True, True, True]
    err = capsys.readouterr().err
    assert "[t] cell 2 ..." in err and "[t]   OOM: CUDA out of memory. Tried to allocate 2.00 GiB\n" in err


def test_each_cell_gets_a_fresh_seeded_training_step():
    from cs336_systems.model.transformer import ModelConfig
    from cs336_systems.training import workload

    cfg = ModelConfig.from_name("tiny", context_length=8)
    cpu = torch.device("cpu")
    first, again = (workload.training_step(cfg, 2, cpu, torch.bfloat16, seed=3) for _ in range(2))
    other = workload.training_step(cfg, 2, cpu, seed=4)
    assert first.model is not again.model and first.autocast_dtype == torch.bfloat16
    assert torch.equal(first.batch[0], again.batch[0]) and first.batch[0].shape == (2, 8)
    assert all(
        torch.equal(a, b) for a, b in zip(first.model.parameters(), again.model.parameters(), strict=True)
    )
    assert not torch.equal(first.batch[0], other.batch[0])
    assert set(first.optimizer.param_groups[0]["params"]) == set(first.model.parameters())
