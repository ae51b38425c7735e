"""ModernBERT-class encoders against transformers' ModernBertForMaskedLM (eager attention,
fp32, dropout off), both ways, on random small configurations with fixed seeds; and the
NeoBERT shape (pre-RMSNorm, SwiGLU, all global, rotary) against a dense reference written
here from the definitions (complex-number rotary, explicit RMSNorm, a banded mask)."""

import json
import math
import random
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
import transformers

from bert.checkpoint.pretrained import export_hf, load_pretrained
from bert.model.config import BertConfig, alternating_layers
from bert.model.hf import load_hf_state_dict, read_config, to_hf_state_dict
from bert.model.hf_modernbert import config_from_hf, config_to_hf
from bert.model.pretraining import BertForPreTraining
from common.errors import CheckpointError, ConfigError
from data.batch import UnpaddedBatch, pad
from tests.batches import random_batch


def random_config(seed: int) -> BertConfig:
    """A small ModernBERT: global every 2 or 3 layers, a window of 16 to 128, odd head counts,
    head dims that are not powers of two, every bias switch drawn."""
    rng = random.Random(seed)
    every = rng.choice([2, 3])
    layers = every + rng.choice([1, 2])
    heads = rng.choice([1, 3, 5])
    head_dim = rng.choice([6, 10, 14])
    return replace(
        BertConfig.preset("modernbert_tiny"),
        vocab_size=rng.choice([61, 97, 131]),
        hidden_size=heads * head_dim,
        num_attention_heads=heads,
        num_hidden_layers=layers,
        intermediate_size=rng.choice([20, 33, 48]),
        hidden_act=rng.choice(["gelu", "gelu_pytorch_tanh", "silu"]),
        layer_types=alternating_layers(layers, every),
        local_window=rng.choice([16, 32, 64, 128]),
        rope_theta_global=rng.choice([10000.0, 160000.0]),
        rope_theta_local=rng.choice([10000.0, 500.0]),
        norm_bias=rng.random() < 0.5,
        attention_bias=rng.random() < 0.5,
        mlp_bias=rng.random() < 0.5,
        head_bias=rng.random() < 0.5,
        decoder_bias=rng.random() < 0.7,
        max_position_embeddings=300,
    )


def lengths_around(window: int) -> list[int]:
    """Sequences shorter and longer than the window, and of length 1."""
    return [1, window // 2 - 1, window + 3, 2, window - 1, min(2 * window + 5, 300)]


def scramble_(model: torch.nn.Module, seed: int) -> None:
    """Weights large enough that attention is far from uniform (a wrong window or theta moves
    the logits by units, not by 1e-6), non-zero biases and norm parameters."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1 + (1.0 if name.endswith("weight") else 0.0))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 2.0 / math.sqrt(p.shape[1]))


def hf_model(config: BertConfig, seed: int):
    hf_config = transformers.ModernBertConfig(**config_to_hf(config), attn_implementation="eager")
    model = transformers.ModernBertForMaskedLM(hf_config).eval()
    scramble_(model, seed)
    model.tie_weights()
    return model


def hf_mlm_logits(model, batch: UnpaddedBatch):
    pb = pad(batch)
    out = model(input_ids=pb.input_ids, attention_mask=pb.attention_mask.long(), position_ids=pb.position_ids)
    return out.logits.reshape(-1, out.logits.shape[-1])[pb.mlm_positions]


SEEDS = range(4)


@pytest.mark.parametrize("seed", SEEDS)
def test_import_matches_transformers(seed):
    config = random_config(seed)
    theirs = hf_model(config, seed)
    ours = BertForPreTraining(config, attention="reference").eval()
    load_hf_state_dict(ours, theirs.state_dict())
    batch = random_batch(lengths_around(config.local_window), config.vocab_size, seed=seed)

    out = ours(batch)
    ref = hf_mlm_logits(theirs, batch)
    assert out.nsp_logits is None
    assert (out.mlm_logits - ref).abs().max() <= 1e-4
    assert ref.abs().max() > 1.0  # the comparison is not between near-zero logits

    F.cross_entropy(out.mlm_logits, batch.mlm_labels).backward()
    F.cross_entropy(ref, batch.mlm_labels).backward()
    grads = to_hf_state_dict(ours, {n: p.grad for n, p in ours.named_parameters()})
    for name, p in theirs.named_parameters():
        err = (grads[name] - p.grad).norm() / max(p.grad.norm(), 1e-4)
        assert err <= 1e-4, f"{name}: relative gradient error {err:.2e}"


def test_window_and_theta_are_seen():
    """The equivalence above would hold for a model that ignored the window or the local
    theta only if the batches could not tell: they can."""
    config = random_config(1)
    theirs = hf_model(config, 1)
    batch = random_batch(lengths_around(config.local_window), config.vocab_size, seed=1)
    ref = hf_mlm_logits(theirs, batch)
    for other in (
        replace(config, local_window=config.local_window * 2),
        replace(config, rope_theta_local=config.rope_theta_local * 3),
    ):
        model = BertForPreTraining(other).eval()
        load_hf_state_dict(model, theirs.state_dict())
        assert (model(batch).mlm_logits - ref).abs().max() > 1e-2


@pytest.mark.parametrize("seed", [0, 3])
def test_export_loads_with_auto_classes(seed, tmp_path):
    from bert.checkpoint.export import write_tokenizer_files
    from tests.bert.checkpoint.test_export import write_vocab

    config = random_config(seed)
    torch.manual_seed(seed)
    ours = BertForPreTraining(config).eval()
    scramble_(ours, seed + 100)
    export_hf(ours, str(tmp_path / "hf"))
    write_tokenizer_files(str(tmp_path / "hf"), str(write_vocab(tmp_path / "vocab.txt")), 128)

    theirs = transformers.AutoModelForMaskedLM.from_pretrained(str(tmp_path / "hf"), attn_implementation="eager")
    assert type(theirs).__name__ == "ModernBertForMaskedLM"
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert tokenizer("The cat")["input_ids"] == [2, 5, 6, 3]  # [CLS] the cat [SEP]
    batch = random_batch(lengths_around(config.local_window), config.vocab_size, seed=seed)
    assert (ours(batch).mlm_logits - hf_mlm_logits(theirs.eval(), batch)).abs().max() <= 1e-4

    # And back: the directory loads into a fresh model bit for bit.
    again = BertForPreTraining(read_config(str(tmp_path / "hf" / "config.json")))
    assert again.config == config
    load_pretrained(again, str(tmp_path / "hf"))
    for name, p in ours.state_dict().items():
        assert torch.equal(p, again.state_dict()[name]), name


@pytest.mark.parametrize("seed", SEEDS)
def test_config_round_trip(seed):
    config = random_config(seed)
    assert config_from_hf(config_to_hf(config)) == config
    hf = transformers.ModernBertConfig(**config_to_hf(config)).to_dict()
    assert config_from_hf(json.loads(json.dumps(hf))) == config


def test_published_base_config_is_the_preset():
    """transformers' ModernBertConfig defaults are ModernBERT-base's shape."""
    hf = transformers.ModernBertConfig().to_dict()
    assert config_from_hf(hf) == BertConfig.preset("modernbert_base")
    shape = dict(hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, intermediate_size=2624)
    large = config_from_hf(transformers.ModernBertConfig(**shape).to_dict())
    assert large == BertConfig.preset("modernbert_large")


def test_bad_configs_are_one_line():
    with pytest.raises(ConfigError, match="layer_types"):
        config_from_hf({"num_hidden_layers": 2, "layer_types": ["full_attention", "chunked"]})
    with pytest.raises(ConfigError, match="rope_type"):
        config_from_hf({"rope_parameters": {"full_attention": {"rope_type": "yarn"}}})
    with pytest.raises(ConfigError, match="unknown ModernBERT field"):
        config_from_hf({"hiden_size": 3})
    with pytest.raises(ConfigError, match="layer_types: 2 entries"):
        BertConfig.preset("modernbert_tiny", num_hidden_layers=3, layer_types=("global", "local"))
    with pytest.raises(ConfigError, match="even head dim"):
        BertConfig.preset("modernbert_tiny", hidden_size=26, num_attention_heads=2)
    with pytest.raises(ConfigError, match="norm_kind='rmsnorm'"):
        config_to_hf(BertConfig.preset("modernbert_tiny", norm_kind="rmsnorm"))
    rms = BertForPreTraining(BertConfig.preset("modernbert_tiny", norm_kind="rmsnorm"))
    with pytest.raises(CheckpointError, match="norm_kind"):
        load_hf_state_dict(rms, {})
    model = BertForPreTraining(BertConfig.preset("modernbert_tiny"))
    sd = to_hf_state_dict(model)
    sd.pop("model.final_norm.weight")
    with pytest.raises(CheckpointError, match="missing keys \\['model.final_norm.weight'\\]"):
        load_hf_state_dict(model, sd)


# ---- the NeoBERT shape against a dense reference written from the definitions ------------------


def neobert_shape(**overrides) -> BertConfig:
    values = dict(
        vocab_size=89,
        hidden_size=30,
        num_attention_heads=3,
        num_hidden_layers=3,
        intermediate_size=40,
        hidden_act="silu",
        norm_kind="rmsnorm",
        norm_bias=False,
        embedding_norm=False,
        first_attn_norm=True,
        layer_types=(),
        rope_theta_global=10000.0,
        layer_norm_eps=1e-6,
    )
    return replace(BertConfig.preset("modernbert_tiny"), **{**values, **overrides})


def dense_reference(model: BertForPreTraining, batch: UnpaddedBatch) -> torch.Tensor:
    """MLM logits of a pre-norm rotary encoder, one sequence at a time with explicit masks."""
    cfg = model.config
    p = dict(model.named_parameters())
    h, d = cfg.num_attention_heads, cfg.head_dim

    def norm(x, name):
        if cfg.norm_kind == "rmsnorm":
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + cfg.layer_norm_eps) * p[f"{name}.weight"]
        mu, var = x.mean(-1, keepdim=True), x.var(-1, unbiased=False, keepdim=True)
        y = (x - mu) / torch.sqrt(var + cfg.layer_norm_eps) * p[f"{name}.weight"]
        return y + p[f"{name}.bias"] if f"{name}.bias" in p else y

    def linear(x, name):
        y = x @ p[f"{name}.weight"].T
        return y + p[f"{name}.bias"] if f"{name}.bias" in p else y

    def rotate(x, theta):  # x [L, H, D]: pair (i, i + D/2) is one complex number
        pos = torch.arange(x.shape[0], dtype=torch.float64)[:, None]
        angle = pos * theta ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)  # [L, D/2]
        z = (
            torch.complex(x[..., : d // 2].double(), x[..., d // 2 :].double())
            * torch.polar(torch.ones_like(angle), angle)[:, None, :]
        )
        return torch.cat([z.real, z.imag], -1).float()

    act = {"silu": F.silu, "gelu": F.gelu, "gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh")}[cfg.hidden_act]
    outs = []
    bounds = batch.cu_seqlens.tolist()
    for start, end in zip(bounds[:-1], bounds[1:]):
        x = p["embeddings.word.weight"][batch.input_ids[start:end]]
        if cfg.embedding_norm:
            x = norm(x, "embeddings.norm")
        n = end - start
        dist = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs()
        for i, window in enumerate(cfg.layer_windows):
            y = x if (i == 0 and not cfg.first_attn_norm) else norm(x, f"layers.{i}.attn_norm")
            q, k, v = linear(y, f"layers.{i}.qkv").view(n, 3, h, d).unbind(1)
            theta = cfg.rope_theta_global if window is None else cfg.rope_theta_local
            q, k = rotate(q, theta), rotate(k, theta)
            scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
            if window is not None:
                scores = scores.masked_fill(dist > window // 2, float("-inf"))
            a = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, h * d)
            x = x + linear(a, f"layers.{i}.attn_out")
            gate_in = linear(norm(x, f"layers.{i}.ffn_norm"), f"layers.{i}.ffn_in")
            x = x + linear(act(gate_in[:, : cfg.intermediate_size]) * gate_in[:, cfg.intermediate_size :],
                           f"layers.{i}.ffn_out")  # fmt: skip
        outs.append(norm(x, "final_norm"))
    x = torch.cat(outs)[batch.mlm_positions]
    x = norm(act(linear(x, "mlm_transform")), "mlm_norm")
    logits = x @ p["embeddings.word.weight"].T
    return logits + p["mlm_bias"] if "mlm_bias" in p else logits


@pytest.mark.parametrize(
    "overrides",
    [{}, {"layer_types": ("local", "global", "local"), "local_window": 10}, {"attention_bias": True, "mlp_bias": True}],
    ids=["neobert", "neobert-windowed", "neobert-biases"],
)
def test_neobert_shape_matches_dense_reference(overrides):
    config = neobert_shape(**overrides)
    torch.manual_seed(5)
    model = BertForPreTraining(config).eval()
    scramble_(model, 5)
    assert isinstance(model.layers[0].attn_norm, torch.nn.RMSNorm)
    batch = random_batch([1, 23, 7, 40], config.vocab_size, seed=5)
    ref = dense_reference(model, batch)
    assert ref.abs().max() > 1.0
    assert (model(batch).mlm_logits - ref).abs().max() <= 1e-4


def test_modernbert_dense_reference_agrees_too():
    """The dense reference above also reads a ModernBERT (LayerNorm, GeGLU, windows)."""
    config = random_config(2)
    model = BertForPreTraining(config).eval()
    scramble_(model, 2)
    batch = random_batch(lengths_around(config.local_window), config.vocab_size, seed=2)
    assert (model(batch).mlm_logits - dense_reference(model, batch)).abs().max() <= 1e-4
