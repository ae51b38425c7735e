"""The full model on a packed batch with the ``flashmask`` backend equals the ``reference``
model on the same sequences unpadded: MLM logits at the masked positions, NSP logits, and
every parameter's gradient (in Triton's interpreter on CPU)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bert.model.config import BertConfig  # noqa: E402
from bert.model.pretraining import BertForPreTraining  # noqa: E402
from data.collate import collate_unpadded  # noqa: E402
from data.hdf5io import from_fixed_arrays  # noqa: E402
from data.packing import collate_packed  # noqa: E402
from tests.batches import fixed_layout  # noqa: E402


def forward_backward(model, batch):
    model.zero_grad(set_to_none=True)
    out = model(batch)
    loss = F.cross_entropy(out.mlm_logits, batch.mlm_labels) + F.cross_entropy(out.nsp_logits, batch.nsp_labels)
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out.mlm_logits.detach(), out.nsp_logits.detach(), grads


@pytest.mark.slow  # the whole model through the interpreted kernel
def test_packed_flashmask_model_equals_reference_unpadded():
    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=512)  # 2 layers, 2 heads of 64
    reference = BertForPreTraining(config, attention="reference").eval()  # eval: no dropout anywhere
    model = BertForPreTraining(config, attention="flashmask").eval()
    model.load_state_dict(reference.state_dict())
    # Lengths chosen so that rows of 128 hold several sequences and some padding.
    block = from_fixed_arrays("test", fixed_layout([1, 40, 65, 9, 120, 3, 77, 50], 512, seed=3))
    unpadded = collate_unpadded(block)
    packed = collate_packed(block, 128).check_values(vocab_size=512)
    assert packed.num_rows == 3 and packed.num_tokens == unpadded.num_tokens

    mlm_ref, nsp_ref, grads_ref = forward_backward(reference, unpadded)
    mlm, nsp, grads = forward_backward(model, packed)
    torch.testing.assert_close(mlm, mlm_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nsp, nsp_ref, rtol=1e-5, atol=1e-5)
    assert grads.keys() == grads_ref.keys() and len(grads) == len(list(model.parameters()))
    for name, g in grads.items():
        rel = float((g - grads_ref[name]).norm() / grads_ref[name].norm().clamp(min=1e-30))
        assert rel <= 1e-4, f"{name}: relative gradient difference {rel:.3g}"

    # The reference backend on the packed batch (dense mask from the bounds) agrees as well.
    mlm_dense, nsp_dense, _ = forward_backward(reference, packed)
    torch.testing.assert_close(mlm_dense, mlm_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(nsp_dense, nsp_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.slow  # the whole model through the interpreted kernel
def test_packed_training_step_with_dropout_runs_and_is_seeded():
    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=256, num_hidden_layers=1)
    model = BertForPreTraining(config, attention="flashmask").train()
    block = from_fixed_arrays("test", fixed_layout([30, 64, 12, 20], 256, seed=4))
    batch = collate_packed(block, 64)
    results = []
    for seed in (5, 5, 6):
        torch.manual_seed(seed)
        mlm, nsp, grads = forward_backward(model, batch)
        assert all(bool(torch.isfinite(g).all()) for g in grads.values())
        results.append(mlm)
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], results[2])
