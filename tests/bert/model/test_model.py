"""The model against transformers.BertForPreTraining (eager attention, fp32, dropout off)."""

import pytest
import torch
import torch.nn.functional as F
import transformers

from bert.checkpoint.pretrained import load_hf_state_dict, to_hf_state_dict
from bert.model.config import BertConfig
from bert.model.pretraining import BertForPreTraining
from data.batch import pad
from tests.batches import random_batch

CASES = [
    # (config, lengths): the maximum length is the config's max_position_embeddings.
    (
        BertConfig(
            vocab_size=30522,
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            max_position_embeddings=512,
        ),
        [1, 2, 97, 128, 512],
    ),
    (
        BertConfig(
            vocab_size=101,
            hidden_size=36,
            num_hidden_layers=2,
            num_attention_heads=3,
            intermediate_size=50,
            max_position_embeddings=200,
        ),
        [97, 1, 200, 2, 128],
    ),
    (
        BertConfig(
            vocab_size=257,
            hidden_size=48,
            num_hidden_layers=3,
            num_attention_heads=4,
            intermediate_size=96,
            max_position_embeddings=130,
            hidden_act="gelu_new",
            layer_norm_eps=1e-5,
        ),
        [2, 130, 1, 97, 128, 130],
    ),
]


def hf_model(config: BertConfig, seed: int):
    torch.manual_seed(seed)
    hf_config = transformers.BertConfig(**config.to_dict(), attn_implementation="eager")
    model = transformers.BertForPreTraining(hf_config).eval()
    # Non-zero biases and LayerNorm parameters, so a mapping mistake cannot hide behind zeros.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.normal_(0.0 if name.endswith("bias") else 1.0, 0.1)
    return model


def hf_logits(model, batch):
    pb = pad(batch)
    out = model(
        input_ids=pb.input_ids,
        token_type_ids=pb.segment_ids,
        attention_mask=pb.attention_mask.long(),
        position_ids=pb.position_ids,
    )
    mlm = out.prediction_logits.reshape(-1, out.prediction_logits.shape[-1])[pb.mlm_positions]
    return mlm, out.seq_relationship_logits


def loss_of(mlm, nsp, batch):
    return F.cross_entropy(mlm, batch.mlm_labels) + F.cross_entropy(nsp, batch.nsp_labels)


@pytest.mark.parametrize("case", range(len(CASES)))
def test_matches_transformers(case):
    config, lengths = CASES[case]
    theirs = hf_model(config, seed=case)
    ours = BertForPreTraining(config, attention="reference").eval()
    load_hf_state_dict(ours, theirs.state_dict())
    batch = random_batch(lengths, config.vocab_size, seed=case)

    out = ours(batch)
    mlm_ref, nsp_ref = hf_logits(theirs, batch)
    assert out.mlm_logits.shape == (batch.mlm_positions.numel(), config.vocab_size)
    assert out.hidden_states.shape == (batch.num_tokens, config.hidden_size)
    assert (out.mlm_logits - mlm_ref).abs().max() <= 1e-4
    assert (out.nsp_logits - nsp_ref).abs().max() <= 1e-4

    loss_of(out.mlm_logits, out.nsp_logits, batch).backward()
    loss_of(mlm_ref, nsp_ref, batch).backward()
    grads = to_hf_state_dict(ours, {n: p.grad for n, p in ours.named_parameters()})
    checked = 0
    for name, p in theirs.named_parameters():
        ref = p.grad
        err = (grads[name] - ref).norm() / max(ref.norm(), 1e-4)
        assert err <= 1e-4, f"{name}: relative gradient error {err:.2e}"
        checked += 1
    assert checked == len(list(theirs.parameters()))


def test_padded_batch_gives_same_outputs():
    config = CASES[1][0]
    model = BertForPreTraining(config, attention="padded").eval()
    batch = random_batch([5, 17, 1, 33], config.vocab_size, seed=3)
    a = model(batch)
    b = model(pad(batch, 40))
    torch.testing.assert_close(a.mlm_logits, b.mlm_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(a.nsp_logits, b.nsp_logits, rtol=1e-5, atol=1e-5)


def test_initialisation_and_tied_decoder():
    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=1000)
    model = BertForPreTraining(config)
    std = model.layers[0].ffn_in.weight.std().item()
    assert abs(std - config.initializer_range) < 0.002
    assert torch.count_nonzero(model.layers[0].qkv.bias) == 0
    assert torch.equal(model.layers[1].attn_norm.weight, torch.ones(config.hidden_size))
    batch = random_batch([4, 9], config.vocab_size)
    out = model(batch)
    out.mlm_logits.sum().backward()
    # The decoder is the word-embedding matrix: MLM gradients reach it.
    assert model.embeddings.word.weight.grad.abs().sum() > 0
    assert sum(p.numel() for p in model.parameters()) == sum(
        p.numel() for n, p in model.named_parameters()
    )  # no duplicated decoder matrix


def test_dropout_active_only_in_training():
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig.preset("tiny", vocab_size=100))
    batch = random_batch([10, 20], 100)
    model.train()
    a, b = model(batch).nsp_logits, model(batch).nsp_logits
    assert not torch.equal(a, b)
    model.eval()
    assert torch.equal(model(batch).nsp_logits, model(batch).nsp_logits)


@pytest.mark.parametrize("impl", ["triton", "epilogue"])
def test_bias_gelu_acts_on_a_pre_norm_dense_mlp(impl, monkeypatch):
    """model.bias_gelu is accepted for any dense GELU MLP with biases, so pre-norm must run it too."""
    import bert.model.layers

    calls = []
    if impl == "epilogue":
        real = bert.model.layers.linear_bias_gelu
        monkeypatch.setattr(bert.model.layers, "linear_bias_gelu", lambda *a: calls.append(1) or real(*a))
    else:
        real = bert.model.layers._fused()
        spy = type("Spy", (), {"bias_gelu": staticmethod(lambda *a: calls.append(1) or real.bias_gelu(*a))})
        monkeypatch.setattr(bert.model.layers, "_fused", lambda: spy)
    config = BertConfig.preset("tiny", vocab_size=96, norm_placement="pre", num_hidden_layers=1)
    model = BertForPreTraining(config, bias_gelu=impl).eval()
    ref = BertForPreTraining(config, bias_gelu="eager").eval()
    ref.load_state_dict(model.state_dict())
    batch = random_batch([5, 17], 96, seed=3)
    torch.testing.assert_close(model(batch).mlm_logits, ref(batch).mlm_logits, atol=1e-5, rtol=1e-5)
    assert calls, f"model.bias_gelu={impl} was accepted but the pre-norm layer never called it"
