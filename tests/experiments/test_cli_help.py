"""Every CLI's --help: the module docstring with its layout (example commands keep their line breaks), a help for
every flag, and the defaults shown."""

import argparse
import importlib
import pkgutil

import pytest

import cs336_systems.experiments
from cs336_systems import cli

CLIS = [
    f"cs336_systems.experiments.{m.name}" for m in pkgutil.iter_modules(cs336_systems.experiments.__path__)
]
CLIS += ["cs336_systems.parallel.launch"]


class _Built(Exception):
    pass


def built_parser(module_name: str, monkeypatch: pytest.MonkeyPatch) -> argparse.ArgumentParser:
    """The parser the CLI builds, taken when it starts parsing (through parse_args, or main where it has none)."""

    def stop(self, args=None, namespace=None):
        raise _Built(self)

    monkeypatch.setattr(cli.Parser, "parse_known_args", stop)
    module = importlib.import_module(module_name)
    with pytest.raises(_Built) as built:
        getattr(module, "parse_args", module.main)([])
    return built.value.args[0]


@pytest.mark.parametrize("module_name", CLIS)
def test_every_flag_has_help_and_the_help_renders(module_name, monkeypatch):
    p = built_parser(module_name, monkeypatch)
    assert isinstance(p, cli.Parser) and p.formatter_class is cli.HelpFormatter
    missing = [
        a.option_strings or [a.dest]
        for a in p._actions
        if not isinstance(a, argparse._HelpAction) and not a.help
    ]
    assert not missing, f"{module_name}: flags without help: {missing}"
    text = p.format_help()
    assert "(default: None)" not in text and "(default: False)" not in text  # only defaults worth showing


def test_the_docstrings_example_keeps_its_lines(monkeypatch):
    text = built_parser("cs336_systems.experiments.ddp_benchmark", monkeypatch).format_help()
    assert "-- cs336_systems.experiments.ddp_benchmark \\\n        --size xl --batch-size 2" in text
    text = built_parser("cs336_systems.experiments.train_step_benchmark", monkeypatch).format_help()
    assert "--stacks plain native ours \\\n        --out results/gpu/train_step/one_gpu.csv" in text


def test_defaults_are_shown(monkeypatch):
    text = " ".join(
        built_parser("cs336_systems.experiments.e2e_benchmark", monkeypatch).format_help().split()
    )
    assert "--seed SEED seed of the random weights and inputs (default: 0)" in text
    assert "--warmup WARMUP steps before the timed ones (default: 5)" in text
    assert "--out OUT CSV to write (a .json provenance file goes beside it) --seed" in text  # required: none
    assert "wrap the model in torch.compile (default" not in text  # a switch: no default shown
