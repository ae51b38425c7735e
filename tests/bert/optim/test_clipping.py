"""Global-norm clipping and AdaGC against straightforward references written here."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from bert.config import AdaGCSection
from bert.optim.clipping import AdaGC, clip_global_
from common.errors import ConfigError

SHAPES = [(8, 5), (5,), (3, 4, 2), (1,), (16,), (7, 7)]


def _params(dtype=torch.float32):
    return [nn.Parameter(torch.zeros(s, dtype=dtype)) for s in SHAPES]


def test_clip_global_matches_definition():
    g = torch.Generator().manual_seed(0)
    for scale, max_norm in ((1.0, 1.0), (0.01, 1.0), (3.0, 0.5)):
        params = _params()
        for p in params:
            p.grad = torch.randn(p.shape, generator=g) * scale
        before = [p.grad.clone() for p in params]
        expected_norm = math.sqrt(sum(float((b.double() ** 2).sum()) for b in before))
        total = clip_global_(params, max_norm)
        assert total.dim() == 0 and math.isclose(float(total), expected_norm, rel_tol=1e-6)
        factor = max_norm / expected_norm if expected_norm > max_norm else 1.0
        for p, b in zip(params, before):
            torch.testing.assert_close(p.grad, b * factor, rtol=1e-6, atol=0)
        if factor == 1.0:
            assert all(torch.equal(p.grad, b) for p, b in zip(params, before))
    # Agrees with torch's clip_grad_norm_ on the norm it reports.
    params = _params()
    for p in params:
        p.grad = torch.randn(p.shape, generator=g)
    ref = torch.nn.utils.get_total_norm([p.grad for p in params])
    assert math.isclose(float(clip_global_(params, 1.0)), float(ref), rel_tol=1e-6)
    with pytest.raises(ValueError, match="max_grad_norm"):
        clip_global_(params, 0.0)


class ReferenceAdaGC:
    """Issue 7's definition, tensor by tensor, in float64 Python scalars."""

    def __init__(self, n, lambda_rel, beta, warmup_steps, lambda_abs, eps):
        self.gamma = [None] * n
        self.t = 0
        self.k = (lambda_rel, beta, warmup_steps, lambda_abs, eps)

    def clip(self, grads):
        """grads: list of float64 tensors or None; returns (clipped grads, global norm, #clipped)."""
        lambda_rel, beta, warmup, lambda_abs, eps = self.k
        self.t += 1
        out = list(grads)
        present = [i for i, g in enumerate(grads) if g is not None]
        norms = {i: float(grads[i].norm()) for i in present}
        total = math.sqrt(sum(v * v for v in norms.values()))
        clipped = 0
        if self.t <= warmup:
            c = min(1.0, lambda_abs / (total + eps))
            for i in present:
                out[i] = grads[i] * c
                n = float(out[i].norm())
                self.gamma[i] = n if self.gamma[i] is None else min(self.gamma[i], n)
            clipped = len(present) if c < 1 else 0
        else:
            for i in present:
                n = norms[i]
                if self.gamma[i] is None:
                    self.gamma[i] = n
                h = min(1.0, lambda_rel * self.gamma[i] / (n + eps))
                out[i] = grads[i] * h
                clipped += h < 1
                self.gamma[i] = beta * self.gamma[i] + (1 - beta) * min(n, lambda_rel * self.gamma[i])
        return out, total, clipped


def _grad_stream(steps, seed=0):
    """Random gradients with injected spikes; tensor 3 has no gradient until step 120."""
    g = torch.Generator().manual_seed(seed)
    for t in range(1, steps + 1):
        grads = []
        for i, s in enumerate(SHAPES):
            x = torch.randn(s, generator=g, dtype=torch.float64) * (0.05 + 0.02 * i)
            if t % 17 == 0 and i == t % len(SHAPES):
                x *= 50.0  # a spike in one tensor
            if t in (40, 130):
                x *= 20.0  # a spike everywhere
            grads.append(None if (i == 3 and t < 120) or (i == 4 and t in (60, 125)) else x)
        yield t, grads


def _set_grads(params, grads):
    for p, x in zip(params, grads):
        p.grad = None if x is None else x.to(p.dtype).clone()


def test_adagc_matches_reference_across_warmup_and_checkpoint():
    kw = dict(lambda_rel=1.04, beta=0.99, warmup_steps=100, lambda_abs=1.0, eps=1e-6)
    params = _params()
    named = [(f"p{i}", p) for i, p in enumerate(params)]
    section = AdaGCSection(lambda_rel=1.04, beta=0.99, warmup_steps=100)  # lambda_abs: optim.max_grad_norm
    adagc = AdaGC(named, section, kw["lambda_abs"])
    ref = ReferenceAdaGC(len(params), **kw)
    clipped_after_warmup = 0
    for t, grads in _grad_stream(160):
        if t == 110:  # checkpoint and restore into a fresh object
            buf = io.BytesIO()
            torch.save(adagc.state_dict(), buf)
            buf.seek(0)
            adagc = AdaGC(named, section, kw["lambda_abs"])
            adagc.load_state_dict(torch.load(buf))
        _set_grads(params, grads)
        stats = adagc.clip_()
        expected, total, n_clipped = ref.clip(grads)
        for i, (p, e) in enumerate(zip(params, expected)):
            if e is None:
                assert p.grad is None
            else:
                torch.testing.assert_close(p.grad.double(), e, rtol=2e-6, atol=1e-9, msg=f"step {t} tensor {i}")
        assert int(stats.num_clipped) == n_clipped, f"step {t}"
        if t <= 100:
            assert math.isclose(float(stats.global_norm), total, rel_tol=1e-6)
        else:
            assert stats.global_norm is None
            clipped_after_warmup += n_clipped
        known = [i for i, g in enumerate(ref.gamma) if g is not None]
        torch.testing.assert_close(
            adagc.gamma[known].double(),
            torch.tensor([ref.gamma[i] for i in known], dtype=torch.float64),
            rtol=2e-6,
            atol=0,
        )
        assert adagc.has_gamma.tolist() == [g is not None for g in ref.gamma]
    # The stream exercised both regimes (the test is not vacuous).
    assert clipped_after_warmup > 5 and ref.gamma[3] is not None


def test_adagc_global_norm_on_request_and_bf16():
    params = _params(torch.bfloat16)
    adagc = AdaGC([(f"p{i}", p) for i, p in enumerate(params)], AdaGCSection(warmup_steps=1))
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)
        expected = math.sqrt(sum(float((p.grad.float() ** 2).sum()) for p in params))
        stats = adagc.clip_(compute_global_norm=True)
        assert math.isclose(float(stats.global_norm), expected, rel_tol=1e-5)
        assert all(p.grad.dtype == torch.bfloat16 for p in params)


def test_adagc_non_finite_step_keeps_state():
    params = _params()
    adagc = AdaGC([(f"p{i}", p) for i, p in enumerate(params)], AdaGCSection(warmup_steps=2))
    for _ in range(3):
        for p in params:
            p.grad = torch.ones(p.shape)
        adagc.clip_()
    before = adagc.gamma.clone()
    params[0].grad = torch.full(params[0].shape, float("inf"))
    for p in params[1:]:
        p.grad = torch.ones(p.shape)
    adagc.clip_()
    assert torch.equal(adagc.gamma, before) and adagc.step == 4


def test_adagc_state_validation():
    params = _params()
    adagc = AdaGC([(f"p{i}", p) for i, p in enumerate(params)])
    state = adagc.state_dict()
    other = AdaGC([(f"q{i}", p) for i, p in enumerate(params)])
    with pytest.raises(ValueError, match="not in this model: p0"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="missing key 'gamma'"):
        adagc.load_state_dict({"step": 1, "names": [], "has_gamma": torch.zeros(0)})
    with pytest.raises(ConfigError, match="optim.adagc.beta"):
        AdaGC([("p", params[0])], AdaGCSection(beta=1.0))


def test_adagc_unstep_on_the_device_reads_nothing():
    """A skipped step taken back with unstep_ leaves the warm-up where it was (the next step is
    still a warm-up step), as today's host-side ``step -= 1``; no host read in either."""
    from tools.device_reads import DeviceReads

    params = _params()
    adagc = AdaGC([(f"p{i}", p) for i, p in enumerate(params)], AdaGCSection(warmup_steps=2))
    twin = AdaGC(
        [(f"q{i}", nn.Parameter(p.detach().clone())) for i, p in enumerate(params)], AdaGCSection(warmup_steps=2)
    )
    g = torch.Generator().manual_seed(5)
    stream = [[torch.randn(p.shape, generator=g) * 4 for p in params] for _ in range(5)]
    stream[1][0][0] = float("nan")  # step 2 is skipped: step 3 is still in warm-up
    for t, grads in enumerate(stream):
        _set_grads(params, grads)
        with DeviceReads(params + [adagc.gamma, adagc.has_gamma]) as reads:
            stats = adagc.clip_(compute_global_norm=True)
            found_inf = ~torch.isfinite(stats.global_norm)
            adagc.unstep_(found_inf)
        assert reads.total == 0, reads.report()
        if t != 1:  # the twin never sees the skipped step
            _set_grads(twin.params, grads)
            twin.clip_()
            for p, q in zip(params, twin.params):
                assert torch.equal(p.grad, q.grad), t
            assert torch.equal(adagc.gamma, twin.gamma) and torch.equal(adagc.has_gamma, twin.has_gamma)
    assert adagc.step == twin.step == 4
