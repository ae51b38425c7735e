"""The rotary embedding kernel in Triton's interpreter against its PyTorch reference: fp32
within 1e-6; bf16 within twice PyTorch's own bf16 error against fp64 when compiled
(flash-attention's method) and within one bf16 ulp in the interpreter; odd lengths with
positions restarting per sequence, forward and backward; and the model with
``rotary_kernel="triton"`` against ``"torch"``."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import pytest  # noqa: E402
import torch  # noqa: E402

from bert.model.config import BertConfig  # noqa: E402
from bert.model.pretraining import BertForPreTraining  # noqa: E402
from kernels.ops.rotary import apply_rotary, apply_rotary_reference, rotary_tables  # noqa: E402
from tests.batches import random_batch  # noqa: E402

LENGTHS = [1, 97, 2, 33]  # odd lengths; positions restart at 0 in every sequence


def positions(lengths) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])


def rotated_fp64(x: torch.Tensor, head_dim: int, theta: float, pos: torch.Tensor) -> torch.Tensor:
    """The rotation in fp64 from its definition (angles in fp64 too)."""
    inv = theta ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angle = pos.double()[:, None] * inv[None, :]
    c, s = angle.cos()[:, None, :], angle.sin()[:, None, :]
    x1, x2 = x.double()[..., : head_dim // 2], x.double()[..., head_dim // 2 :]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), -1)


@pytest.mark.parametrize("head_dim", [10, 64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_matches_reference(dtype, head_dim):
    g = torch.Generator().manual_seed(head_dim)
    n, h = sum(LENGTHS), 3
    # q as the model makes it: a strided view of the fused QKV output.
    qkv = torch.randn(n, 3, h, head_dim, generator=g).to(dtype).requires_grad_()
    q = qkv[:, 0]
    pos = positions(LENGTHS)
    cos, sin = rotary_tables(head_dim, 10000.0, 128)

    out = apply_rotary(q, cos, sin, pos)
    ref = apply_rotary_reference(q, cos, sin, pos)
    dy = torch.randn(out.shape, generator=g).to(dtype)
    (dq,) = torch.autograd.grad(out, qkv, dy)
    (dq_ref,) = torch.autograd.grad(ref, qkv, dy)
    assert out.dtype == dtype and out.shape == q.shape
    assert dq[:, 1:].abs().max() == 0  # k and v slices get no gradient

    exact = rotated_fp64(q.detach(), head_dim, 10000.0, pos)
    exact_grad = rotated_fp64(dy, head_dim, 10000.0, -pos)  # the inverse rotation
    if dtype == torch.float32:
        assert (out - ref).abs().max() <= 1e-6
        assert (dq[:, 0] - dq_ref[:, 0]).abs().max() <= 1e-6
    else:
        for got, want, base in ((out, exact, ref), (dq[:, 0], exact_grad, dq_ref[:, 0])):
            if torch.cuda.is_available():  # compiled: rounds to nearest, as PyTorch does
                err, base_err = (got.double() - want).abs().max(), (base.double() - want).abs().max()
                assert err <= 2 * base_err + 1e-6, f"kernel error {err:.2e}, PyTorch bf16 error {base_err:.2e}"
            else:
                # Triton's interpreter casts fp32 to bf16 by truncation (its cast_impl passes no
                # rounding mode), so each element is within one bf16 ulp (2^-7 relative) of the
                # exact value rather than half of one.
                err = (got.double() - want).abs() - 2.0**-7 * want.abs()
                assert err.max() <= 1e-6, f"kernel beyond one bf16 ulp by {err.max():.2e}"


def test_positions_restart_per_sequence():
    """Each sequence of the flat batch is rotated as if it were alone."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(sum(LENGTHS), 2, 10, generator=g)
    cos, sin = rotary_tables(10, 500.0, 128)
    out = apply_rotary(x, cos, sin, positions(LENGTHS))
    start = 0
    for n in LENGTHS:
        alone = apply_rotary(x[start : start + n].contiguous(), cos, sin, torch.arange(n))
        assert torch.equal(out[start : start + n], alone)
        start += n
    assert torch.equal(out[0], x[0])  # position 0 is the identity


def test_model_with_triton_rotary_matches_torch():
    config = BertConfig.preset("modernbert_tiny", vocab_size=61, hidden_size=30, num_attention_heads=3)
    torch.manual_seed(0)
    ref = BertForPreTraining(config, rotary_kernel="torch").eval()
    fast = BertForPreTraining(config, rotary_kernel="triton").eval()
    fast.load_state_dict(ref.state_dict())
    batch = random_batch([1, 45, 7], config.vocab_size, seed=0)
    a, b = ref(batch).mlm_logits, fast(batch).mlm_logits
    assert (a - b).abs().max() <= 1e-5
    a.sum().backward()
    b.sum().backward()
    for (name, p), q in zip(ref.named_parameters(), fast.parameters()):
        assert (p.grad - q.grad).abs().max() <= 1e-5 * max(1.0, p.grad.abs().max()), name


def test_bad_tables_are_one_line():
    x = torch.zeros(4, 1, 8)
    cos, sin = rotary_tables(6, 10000.0, 16)
    with pytest.raises(ValueError, match="do not fit head dim 8"):
        apply_rotary(x, cos, sin, torch.arange(4))
    with pytest.raises(ValueError, match="even"):
        rotary_tables(7, 10000.0, 16)
    with pytest.raises(ValueError, match="rotary_kernel"):
        BertForPreTraining(BertConfig.preset("modernbert_tiny"), rotary_kernel="cuda")
