"""The full model with the Triton attention backends (and the fused ops) matches the
``reference`` model in logits and in every parameter's gradient, in Triton's interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bert.model.config import BertConfig  # noqa: E402
from bert.model.pretraining import BertForPreTraining  # noqa: E402
from tests.batches import random_batch  # noqa: E402


def forward_backward(model, batch):
    out = model(batch)
    loss = F.cross_entropy(out.mlm_logits, batch.mlm_labels) + F.cross_entropy(out.nsp_logits, batch.nsp_labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.mlm_logits.detach(), out.nsp_logits.detach(), grads


@pytest.mark.slow  # the whole model through the interpreted kernels
@pytest.mark.parametrize("attention,fused_ops", [("triton", False), ("triton_grouped", True)])
def test_model_matches_reference(attention, fused_ops):
    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=512)  # 2 layers, 2 heads of 64
    reference = BertForPreTraining(config, attention="reference").eval()  # eval: no dropout anywhere
    model = BertForPreTraining(config, attention=attention, fused_ops=fused_ops).eval()
    model.load_state_dict(reference.state_dict())
    batch = random_batch([1, 40, 65, 9, 120], config.vocab_size, seed=3)
    mlm_ref, nsp_ref, grads_ref = forward_backward(reference, batch)
    mlm, nsp, grads = forward_backward(model, batch)
    torch.testing.assert_close(mlm, mlm_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nsp, nsp_ref, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(model.parameters()))
    for name, g in grads.items():
        torch.testing.assert_close(g, grads_ref[name], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")
