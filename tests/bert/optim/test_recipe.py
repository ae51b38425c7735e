"""ModernBERT's recipe pieces: the warmup-stable-decay schedule (linear and one-minus-sqrt
decay), the masked-LM-only loss, AdamW's weight-decay groups for a bias-free pre-norm model,
and the presets' published shapes."""

import math

import pytest
import torch
import torch.nn.functional as F

from bert.model.config import BertConfig
from bert.model.pretraining import BertForPreTraining
from bert.optim.optimizers import param_groups_for
from bert.optim.schedule import wsd_lr_at
from bert.train.losses import pretraining_loss
from tests.batches import random_batch
from tests.bert.optim.test_optimizers import ULP_OF_A_ROOT


def test_wsd_schedule_shape():
    kw = dict(base_lr=8e-4, total_steps=100, warmup_steps=10, decay_steps=20)
    lrs = [wsd_lr_at(s, **kw) for s in range(110)]
    assert lrs[0] == 0.0 and lrs[5] == pytest.approx(4e-4) and lrs[10] == 8e-4
    assert all(lr == 8e-4 for lr in lrs[10:80])  # stable until the last 20 steps
    assert lrs[80] == 8e-4 and lrs[100] == lrs[109] == 0.0
    for s in range(81, 100):
        p = (s - 80) / 20
        assert lrs[s] == pytest.approx(8e-4 * (1 - math.sqrt(p)))
        assert wsd_lr_at(s, **kw, decay_shape="linear") == pytest.approx(8e-4 * (1 - p))
    # 1-sqrt drops faster early in the decay and ends at the same point.
    assert lrs[85] < wsd_lr_at(85, **kw, decay_shape="linear")
    assert wsd_lr_at(100, **kw, end_lr=1e-5) == pytest.approx(1e-5)
    assert wsd_lr_at(50, base_lr=1.0, total_steps=100) == 1.0  # no warm-up, no decay: constant


@pytest.mark.parametrize("shape", ["1-sqrt", "linear"])
@pytest.mark.parametrize("decay_steps", [0, 20])
def test_wsd_on_the_device_equals_the_host_schedule(shape, decay_steps):
    """The trainer keeps the rate in a device tensor (bert.optim.schedule, device=...): under
    optim.schedule=wsd it must be wsd_lr_at's value, not the poly schedule's."""
    from bert.config import OptimSection
    from bert.optim.schedule import WarmupDecaySchedule

    section = OptimSection(
        lr=8e-4, warmup_steps=10, schedule="wsd" if shape == "1-sqrt" else "wsd_linear", decay_steps=decay_steps
    )

    def scheduler(**kw):
        return WarmupDecaySchedule(torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=1.0), section, 100, **kw)

    host, dev = scheduler(), scheduler(device="cpu")
    for step in range(110):
        want = wsd_lr_at(
            step, base_lr=8e-4, total_steps=100, warmup_steps=10, decay_steps=decay_steps, decay_shape=shape
        )
        assert host.optimizer.param_groups[0]["lr"] == want, step
        assert abs(dev.lr.item() - want) <= 2 * ULP_OF_A_ROOT * 8e-4, step  # 1-sqrt: a bit off on some CPUs
        host.step()
        dev.step(torch.tensor(False))
    assert dev.applied_lr().item() == wsd_lr_at(
        109, base_lr=8e-4, total_steps=100, warmup_steps=10, decay_steps=decay_steps, decay_shape=shape
    )


def test_mlm_only_loss_is_the_masked_lm_cross_entropy():
    config = BertConfig.preset("modernbert_tiny", vocab_size=61)
    torch.manual_seed(0)
    model = BertForPreTraining(config)
    batch = random_batch([5, 30, 2], config.vocab_size, seed=0)
    out = model(batch)
    assert out.nsp_logits is None
    num_masked = batch.mlm_labels.numel()
    loss, stats = pretraining_loss(
        out.mlm_logits, batch.mlm_labels, None, batch.nsp_labels, num_masked * 2, 6, with_accuracy=True
    )
    want = F.cross_entropy(out.mlm_logits, batch.mlm_labels, reduction="sum") / (num_masked * 2)
    assert torch.equal(loss, want)
    assert stats["nsp_loss_sum"] == 0 and stats["nsp_correct"] == 0
    assert "pooler.weight" not in model.state_dict() and "nsp.weight" not in model.state_dict()


def test_adamw_groups_leave_norms_and_biases_undecayed():
    for config in (
        BertConfig.preset("modernbert_tiny", vocab_size=61, attention_bias=True),
        BertConfig.preset("modernbert_tiny", vocab_size=61, norm_kind="rmsnorm", norm_bias=False),
    ):
        model = BertForPreTraining(config)
        decay, no_decay = param_groups_for(model, 1e-5)
        names = {id(p): n for n, p in model.named_parameters()}
        assert all(p.ndim == 2 for p in decay["params"])
        undecayed = {names[id(p)] for p in no_decay["params"]}
        assert "layers.1.attn_norm.weight" in undecayed and "final_norm.weight" in undecayed
        assert "mlm_bias" in undecayed
        assert ("layers.0.qkv.bias" in undecayed) == config.attention_bias
        assert no_decay["weight_decay"] == 0.0 and decay["weight_decay"] == 1e-5


def test_presets_have_the_published_shapes():
    base, large = BertConfig.preset("modernbert_base"), BertConfig.preset("modernbert_large")
    shape = lambda c: (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.intermediate_size)  # noqa: E731
    assert shape(base) == (22, 768, 12, 1152) and shape(large) == (28, 1024, 16, 2624)
    for c in (base, large):
        assert c.vocab_size == 50368 and c.local_window == 128 and c.max_position_embeddings == 8192
        assert (c.rope_theta_global, c.rope_theta_local) == (160000.0, 10000.0)
        assert c.layer_windows[::3] == (None,) * len(c.layer_windows[::3])  # a global layer every 3rd
        assert all(w == 128 for i, w in enumerate(c.layer_windows) if i % 3)
    with torch.device("meta"):  # counted, not allocated
        n_params = sum(p.numel() for p in BertForPreTraining(base).parameters())
    assert 149e6 < n_params < 150e6  # "149 million" (arXiv:2412.13663)
