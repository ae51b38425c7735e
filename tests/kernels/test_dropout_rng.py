"""The kernels' device-side dropout RNG (``kernels.runtime.philox_from``), in Triton's
interpreter on CPU: the Philox (seed, offset) is a device tensor the kernels read through a
pointer, a draw advances it on the device, the backward replays the forward's saved pair, and
the host never reads it."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before anything imports Triton

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import kernels.varlen_attention as va  # noqa: E402
from kernels.ops.fused import bias_dropout_add_layer_norm  # noqa: E402
from kernels.runtime import draw_philox, philox_from, philox_state, seed_philox_  # noqa: E402
from kernels.varlen_attention import Call, varlen_attention  # noqa: E402
from tests.kernels.dropout_masks import bias_dropout_add_layer_norm_with_mask, varlen_attention_with_dropout_mask  # noqa: E402
from tests.kernels.test_kernels_attention import make_inputs, masked_reference, run  # noqa: E402
from tools.device_reads import DeviceReads  # noqa: E402

LENGTHS, HEADS, DIM, P = [5, 37, 64], 2, 32, 0.3
SEED = 2**40 + 17


def test_a_draw_advances_the_device_state_and_inside_a_context_only():
    state = seed_philox_(philox_state("cpu"), SEED)
    with philox_from(state):
        first, second = draw_philox(P), draw_philox(P)
        assert torch.equal(draw_philox(0.0), torch.zeros(2, dtype=torch.int64))  # no dropout: nothing drawn
    assert first.tolist() == [SEED, 0] and second.tolist() == [SEED, 1]
    assert state.tolist() == [SEED, 2]
    torch.manual_seed(3)
    outside = draw_philox(P)  # torch's generator, as before: the state does not move
    torch.manual_seed(3)
    assert torch.equal(outside, draw_philox(P)) and state.tolist() == [SEED, 2]
    with pytest.raises(ValueError, match="the Philox state is on cpu, the tensors on meta"):
        with philox_from(state):
            draw_philox(P, "meta")


def test_attention_calls_in_a_row_differ_restoring_the_state_repeats_them_and_backward_replays():
    qkv, dout, cu = make_inputs(LENGTHS, HEADS, DIM, torch.float32, seed=3)
    s = max(LENGTHS)
    state = seed_philox_(philox_state("cpu"), SEED)
    q = qkv.detach().clone().requires_grad_()
    with philox_from(state):
        out1 = varlen_attention(q[:, 0], q[:, 1], q[:, 2], cu, s, dropout_p=P)
        out2 = varlen_attention(*qkv.unbind(1), cu, s, dropout_p=P)
    assert not torch.equal(out1.detach(), out2)
    # The backward runs after the state moved on (and was reseeded): it uses the forward's saved pair.
    seed_philox_(state, SEED + 1)
    out1.backward(dout)
    grads = q.grad.unbind(1)

    seed_philox_(state, SEED)  # restore: the same two masks again
    with philox_from(state):
        again1, keep1 = varlen_attention_with_dropout_mask(*qkv.unbind(1), cu, s, P)
        again2, keep2 = varlen_attention_with_dropout_mask(*qkv.unbind(1), cu, s, P)
    assert torch.equal(again1, out1.detach()) and torch.equal(again2, out2)
    assert not torch.equal(keep1, keep2)

    ref_out, ref_grads = run(lambda a, b, c: masked_reference(a, b, c, cu, keep1, P), qkv.double(), dout.double())
    for name, a, b in zip(("out", "dq", "dk", "dv"), (out1.detach(), *grads), (ref_out, *ref_grads)):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-5, msg=lambda m: f"{name}: {m}")


def test_fused_op_calls_in_a_row_differ_restoring_the_state_repeats_them_and_backward_replays():
    g = torch.Generator().manual_seed(4)
    r, n, eps = 19, 48, 1e-12
    x, res, dy = (torch.randn(r, n, generator=g) for _ in range(3))
    bias, weight, ln_bias = (torch.randn(n, generator=g) for _ in range(3))
    state = seed_philox_(philox_state("cpu"), SEED)
    leaves = [t.clone().requires_grad_() for t in (x, bias, res)]
    with philox_from(state):
        y1 = bias_dropout_add_layer_norm(*leaves, weight, ln_bias, P, eps, True)
        y2 = bias_dropout_add_layer_norm(x, bias, res, weight, ln_bias, P, eps, True)
    assert not torch.equal(y1.detach(), y2)
    seed_philox_(state, SEED + 1)
    y1.backward(dy)

    seed_philox_(state, SEED)
    with philox_from(state):
        again1, keep = bias_dropout_add_layer_norm_with_mask(x, bias, res, weight, ln_bias, P, eps)
        again2, _ = bias_dropout_add_layer_norm_with_mask(x, bias, res, weight, ln_bias, P, eps)
    assert torch.equal(again1, y1.detach()) and torch.equal(again2, y2)

    ref = [t.double().requires_grad_() for t in (x, bias, res)]
    y_ref = F.layer_norm(ref[2] + (ref[0] + ref[1]) * keep / (1 - P), (n,), weight.double(), ln_bias.double(), eps)
    y_ref.backward(dy.double())
    torch.testing.assert_close(y1.detach().double(), y_ref.detach(), rtol=1e-5, atol=1e-5)
    for got, want in zip(leaves, ref):
        torch.testing.assert_close(got.grad.double(), want.grad, rtol=1e-5, atol=1e-5)


def test_a_step_seed_reproduces_its_masks_and_another_seed_or_step_differs():
    """The trainer's per-step seeding (bert.state.seed_step): the masks depend on (run
    seed, step, rank) alone, not on what the state drew before."""
    from bert.state import seed_step

    g = torch.Generator().manual_seed(6)
    x, res, vec = torch.randn(4, 64, generator=g), torch.randn(4, 64, generator=g), torch.randn(64, generator=g)
    state = philox_state("cpu")

    def mask(seed, step, rank=0, draws_before=0):
        seed_step(seed, step, rank, state)
        with philox_from(state):
            for _ in range(draws_before):
                draw_philox(P)
            return bias_dropout_add_layer_norm_with_mask(x, vec, res, vec, vec, P, 1e-12)[1]

    first = mask(5, 3)
    assert torch.equal(mask(5, 3), first)
    for other in (mask(6, 3), mask(5, 4), mask(5, 3, rank=1), mask(5, 3, draws_before=1)):
        assert not torch.equal(other, first)


def test_the_host_never_reads_the_state():
    """Every input is a device tensor (CPU ones, counted as a GPU's would be), the lengths
    are a host fact: the forward and backward of both ops read nothing back. The attention
    op is a ``torch.library`` custom op, whose body a dispatch mode does not see, so its
    implementation is also run under the count directly."""
    qkv, dout, cu = make_inputs(LENGTHS, HEADS, DIM, torch.float32, seed=5)
    state = philox_state("cpu")
    q = qkv.detach().clone().requires_grad_()
    x, res = torch.randn(7, 32), torch.randn(7, 32)
    vec = torch.randn(32, requires_grad=True)
    call = Call(cu, max(LENGTHS), softmax_scale=DIM**-0.5, dropout_p=P)
    with DeviceReads(mark=[state, q, dout, x, res, vec]) as reads:
        seed_philox_(state, SEED)
        with philox_from(state):
            out = varlen_attention(q[:, 0], q[:, 1], q[:, 2], cu, max(LENGTHS), dropout_p=P)
            y = bias_dropout_add_layer_norm(x, vec, res, vec, vec, P, 1e-12, True)
            rng = draw_philox(P)
        (out * dout).sum().backward()
        y.sum().backward()
        a, b, c = (t.detach() for t in q.unbind(1))
        o, lse = va._fwd_impl(a, b, c, call, rng)
        va._bwd_impl(dout, a, b, c, o, lse, rng, call)
    assert reads.total == 0, reads.report()
    assert state.tolist() == [SEED, 3]
    assert not torch.equal(o, out.detach())  # a third draw: its own mask
