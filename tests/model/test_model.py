"""The Transformer LM: shapes, parameter counts against the closed form, causality, RoPE."""

import pytest
import torch

from cs336_systems.model.sizes import MODEL_SIZES as SIZES
from cs336_systems.model.transformer import (
    ModelConfig,
    RotaryEmbedding,
    TransformerBlock,
    TransformerLM,
    initial_values,
)


def tiny(**overrides) -> ModelConfig:
    return ModelConfig(
        **{
            "vocab_size": 97,
            "context_length": 32,
            "d_model": 48,
            "num_layers": 2,
            "num_heads": 4,
            "d_ff": 96,
            **overrides,
        }
    )


@pytest.mark.parametrize("size", sorted(SIZES))
def test_parameter_count_matches_formula(size):
    dims = SIZES[size]
    cfg = ModelConfig.from_name(size, context_length=128)
    with torch.device("meta"):  # no memory for the 2.7B model
        model = TransformerLM(cfg)
    counted = sum(p.numel() for p in model.parameters())
    d, v, L, f = dims["d_model"], 10_000, dims["num_layers"], dims["d_ff"]
    assert counted == cfg.num_parameters() == 2 * v * d + L * (4 * d * d + 3 * d * f + 2 * d) + d


def test_known_parameter_counts():
    # Hand-computed: 2*V*d + L*(4d^2 + 3*d*d_ff + 2d) + d. With SwiGLU's three matrices the spec's "2.7B" row has
    # 3.4B parameters.
    assert ModelConfig(**SIZES["xl"]).num_parameters() == 1_998_235_200
    assert ModelConfig(**SIZES["2.7B"]).num_parameters() == 3_406_809_600


def test_logits_shape_and_no_biases():
    cfg = tiny()
    model = TransformerLM(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (3, 17))
    assert model(tokens).shape == (3, 17, cfg.vocab_size)
    assert not any(name.endswith("bias") for name, _ in model.named_parameters())
    assert model.embedding.weight.data_ptr() != model.lm_head.weight.data_ptr()  # untied


@pytest.mark.parametrize("attention", ["naive", "sdpa"])
def test_causal_future_tokens_do_not_change_earlier_logits(attention):
    torch.manual_seed(0)
    cfg = tiny(attention=attention)
    model = TransformerLM(cfg).double()
    tokens = torch.randint(0, cfg.vocab_size, (2, 20))
    changed = tokens.clone()
    changed[:, 12:] = (changed[:, 12:] + 1) % cfg.vocab_size
    before, after = model(tokens), model(changed)
    torch.testing.assert_close(before[:, :12], after[:, :12], rtol=0, atol=1e-12)
    assert not torch.allclose(before[:, 12:], after[:, 12:])


def test_naive_and_sdpa_attention_agree():
    torch.manual_seed(1)
    naive = TransformerLM(tiny()).double()
    sdpa = TransformerLM(tiny(attention="sdpa")).double()
    sdpa.load_state_dict(naive.state_dict())
    tokens = torch.randint(0, 97, (2, 31))
    torch.testing.assert_close(naive(tokens), sdpa(tokens), rtol=1e-10, atol=1e-10)


def test_a_model_built_on_the_meta_device_gets_the_plain_models_values_one_child_at_a_time(monkeypatch):
    """initial_values: every parameter and buffer of a meta-device model, each for its own module and equal to the
    plain model's from the same seed (to the bit); one top-level child built at a time; the RNG left where the
    plain build leaves it."""
    cfg = tiny(num_layers=3)
    torch.manual_seed(5)
    plain = TransformerLM(cfg)
    after_plain = torch.rand(8)
    torch.manual_seed(5)
    with torch.device("meta"):
        meta = TransformerLM(cfg)
    names = {id(module): name for name, module in meta.named_modules()}
    expected = {**dict(plain.named_parameters()), **dict(plain.named_buffers())}
    seen, built = [], []
    construct = TransformerBlock.__init__

    def counted(self, *args, **kwargs):
        built.append(len(seen))  # how many values had been handed out when a block was built
        construct(self, *args, **kwargs)

    monkeypatch.setattr(TransformerBlock, "__init__", counted)
    for owner, attr, value in initial_values(meta, torch.device("cpu")):
        name = f"{names[id(owner)]}.{attr}"
        assert torch.equal(value, expected[name]), name
        seen.append(name)
    assert sorted(seen) == sorted(expected)
    assert torch.equal(torch.rand(8), after_plain)
    # the three blocks built for the construction's draws before any value, then each just before its values
    per_block = len([name for name in seen if name.startswith("blocks.0.")])
    assert built == [0, 0, 0, 1, 1 + per_block, 1 + 2 * per_block]


def test_rope_scores_depend_only_on_relative_position():
    torch.manual_seed(2)
    rope = RotaryEmbedding(d_head=16, context_length=64, theta=10_000.0)
    q, k = torch.randn(16), torch.randn(16)

    def score(i, j):
        qi = rope(q.view(1, 16), torch.tensor([i]))
        kj = rope(k.view(1, 16), torch.tensor([j]))
        return (qi * kj).sum()

    torch.testing.assert_close(score(5, 2), score(40, 37), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(score(0, 0), (q * k).sum(), rtol=1e-6, atol=1e-6)  # position 0 is the identity
    assert not torch.isclose(score(5, 2), score(5, 3))


def test_rope_preserves_norm():
    rope = RotaryEmbedding(d_head=8, context_length=16, theta=10_000.0)
    x = torch.randn(2, 16, 8)
    torch.testing.assert_close(rope(x, torch.arange(16)).norm(dim=-1), x.norm(dim=-1))


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"d_model": 50}, "not divisible by num_heads"),
        ({"num_layers": 0}, "num_layers must be positive"),
        ({"attention": "magic"}, "attention='magic'"),
    ],
)
def test_bad_config_names_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        tiny(**overrides)


def test_sequence_longer_than_context_is_rejected():
    model = TransformerLM(tiny(context_length=8))
    with pytest.raises(ValueError, match="exceeds context_length 8"):
        model(torch.zeros(1, 9, dtype=torch.long))


def test_an_unknown_size_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown model size 'huge'; known: tiny, small"):
        ModelConfig.from_name("huge")


def test_a_named_size_with_one_dimension_overridden():
    cfg = ModelConfig.from_name("small", num_layers=4, context_length=64)
    assert (cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.context_length) == (4, 768, 12, 64)
