"""LAMB against a plain per-tensor reference, weight-decay groups, optimizer factory, LR schedule."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn

from bert.config import OptimSection
from bert.optim.optimizers import Lamb, apex_lamb_available, build_optimizer, param_groups_for
from bert.optim.schedule import WarmupDecaySchedule, poly_lr_at, wsd_lr_at
from common.errors import ConfigError


class TinyNet(nn.Module):
    """Embedding + LayerNorm + Linear layers + a tied decoder + a free bias: BERT's kinds of tensors."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 6)
        self.norm = nn.LayerNorm(6)
        self.fc = nn.Linear(6, 5)
        self.zero_fc = nn.Linear(5, 6)  # starts at zero weight: trust ratio 1 on the first step
        nn.init.zeros_(self.zero_fc.weight)
        self.out_bias = nn.Parameter(torch.zeros(11))
        self.unused = nn.Linear(3, 3)  # never gets a gradient

    def forward(self, ids):
        x = self.norm(self.emb(ids))
        x = x + self.zero_fc(torch.tanh(self.fc(x)))
        return x @ self.emb.weight.t() + self.out_bias  # tied decoder


def reference_lamb_step(params, grads, states, step, lr, betas, eps, wd, adapt):
    """One LAMB step written per tensor, straight from the MLPerf/apex definition."""
    b1, b2 = betas
    for p, g, st in zip(params, grads, states):
        if g is None:
            continue
        st["m"] = b1 * st["m"] + (1 - b1) * g
        st["v"] = b2 * st["v"] + (1 - b2) * g * g
        m_hat = st["m"] / (1 - b1**step)
        v_hat = st["v"] / (1 - b2**step)
        u = m_hat / (v_hat.sqrt() + eps) + wd * p
        ratio = 1.0
        if adapt:
            w_norm, u_norm = p.norm().item(), u.norm().item()
            if w_norm > 0 and u_norm > 0:
                ratio = w_norm / u_norm
        p.sub_(lr * ratio * u)


def _loss(model, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 11, (7,), generator=g)
    target = torch.randint(0, 11, (7,), generator=g)
    return nn.functional.cross_entropy(model(ids), target)


@pytest.mark.parametrize("use_nvlamb", [False, True])
def test_lamb_matches_per_tensor_reference(use_nvlamb):
    torch.manual_seed(0)
    model = TinyNet().double()
    ref_model = copy.deepcopy(model)
    initial = copy.deepcopy(model)
    wd, betas, eps = 0.01, (0.9, 0.999), 1e-6
    opt = Lamb(param_groups_for(model, wd), lr=0.0, betas=betas, eps=eps, use_nvlamb=use_nvlamb)
    ref_groups = param_groups_for(ref_model, wd)
    ref_states = [[{"m": torch.zeros_like(p), "v": torch.zeros_like(p)} for p in g["params"]] for g in ref_groups]
    for step in range(1, 7):
        lr = 0.05 * step / 6  # changes every step, as a schedule does
        for m in (model, ref_model):
            m.zero_grad(set_to_none=True)
            _loss(m, seed=step).backward()
        for group in opt.param_groups:
            group["lr"] = lr
        opt.step()
        with torch.no_grad():
            for g, states in zip(ref_groups, ref_states):
                reference_lamb_step(
                    g["params"],
                    [p.grad for p in g["params"]],
                    states,
                    step,
                    lr,
                    betas,
                    eps,
                    g["weight_decay"],
                    adapt=g["weight_decay"] != 0 or use_nvlamb,
                )
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14, msg=name)
    assert model.unused.weight.grad is None and model.unused.weight not in opt.state
    assert all(g["step"] == 6 for g in opt.param_groups)
    # The test moved every trained tensor (it would pass vacuously otherwise).
    for (name, p), q in zip(model.named_parameters(), initial.parameters()):
        if not name.startswith("unused"):
            assert not torch.equal(p, q), name


def test_lamb_trust_ratio_changes_the_step():
    """With adaptation on, a large weight takes a step proportional to its norm."""
    for scale in (1.0, 100.0):
        w = nn.Parameter(torch.full((4,), scale))
        opt = Lamb([{"params": [w], "weight_decay": 0.01}], lr=0.1)
        w.grad = torch.ones(4)
        before = w.detach().clone()
        opt.step()
        # First step: m_hat/sqrt(v_hat) = 1, so u = 1 + 0.01*w and the step is lr * ||w|| per unit u.
        u = 1 + 0.01 * before
        expected = before - 0.1 * (before.norm() / u.norm()) * u
        torch.testing.assert_close(w.detach(), expected)


def test_lamb_state_dict_resume_is_bitwise():
    torch.manual_seed(1)
    a = TinyNet()
    b = copy.deepcopy(a)
    opt_a = Lamb(param_groups_for(a, 0.01), lr=0.02)
    for step in range(5):
        a.zero_grad()
        _loss(a, step).backward()
        opt_a.step()
        if step == 2:
            buf = io.BytesIO()
            torch.save({"model": a.state_dict(), "opt": opt_a.state_dict()}, buf)
    buf.seek(0)
    saved = torch.load(buf)
    b.load_state_dict(saved["model"])
    opt_b = Lamb(param_groups_for(b, 0.01), lr=0.02)
    opt_b.load_state_dict(saved["opt"])
    for step in range(3, 5):
        b.zero_grad()
        _loss(b, step).backward()
        opt_b.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_param_groups_by_module_type_and_rank():
    model = TinyNet()
    groups = param_groups_for(model, 0.01)
    decay, no_decay = (set(map(id, g["params"])) for g in groups)
    assert [g["weight_decay"] for g in groups] == [0.01, 0.0]
    expect_decay = {model.emb.weight, model.fc.weight, model.zero_fc.weight, model.unused.weight}
    assert decay == set(map(id, expect_decay))
    expect_no = {
        model.norm.weight,
        model.norm.bias,
        model.fc.bias,
        model.zero_fc.bias,
        model.out_bias,
        model.unused.bias,
    }
    assert no_decay == set(map(id, expect_no))
    # A tied parameter appears once; a frozen one not at all.
    model.fc.weight.requires_grad_(False)
    groups = param_groups_for(model, 0.01)
    ids = [id(p) for g in groups for p in g["params"]]
    assert len(ids) == len(set(ids)) and id(model.fc.weight) not in ids


def test_param_groups_on_the_bert_model():
    from bert.model.config import BertConfig
    from bert.model.pretraining import BertForPreTraining

    model = BertForPreTraining(BertConfig.preset("tiny"))
    groups = param_groups_for(model, 0.01)
    names = {id(p): n for n, p in model.named_parameters()}
    decay = sorted(names[id(p)] for p in groups[0]["params"])
    no_decay = sorted(names[id(p)] for p in groups[1]["params"])
    assert len(decay) + len(no_decay) == len(names)
    assert all(model.get_parameter(n).ndim == 2 for n in decay)
    assert all("norm" in n or n.endswith("bias") for n in no_decay)
    assert "embeddings.word.weight" in decay


def test_build_optimizer_choices():
    model = TinyNet()
    opt = build_optimizer(OptimSection(name="lamb", lr=1e-3, weight_decay=0.01), model)
    assert type(opt) is Lamb and [g["weight_decay"] for g in opt.param_groups] == [0.01, 0.0]
    opt = build_optimizer(OptimSection(name="adamw", lr=1e-3, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1), model)
    assert isinstance(opt, torch.optim.AdamW)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0] and opt.param_groups[0]["betas"] == (0.8, 0.99)
    with pytest.raises(ConfigError, match="optim.name"):
        build_optimizer(OptimSection(name="sgd", lr=1e-3), model)
    with pytest.raises(ConfigError, match="optim.lr"):
        build_optimizer(OptimSection(name="lamb", lr=-1.0), model)
    with pytest.raises(ConfigError, match="optim.betas"):
        build_optimizer(OptimSection(name="lamb", lr=1e-3, betas=(0.9, 1.0)), model)
    if not (apex_lamb_available() and torch.cuda.is_available()):
        with pytest.raises(ValueError, match="impl: 'apex' asked for"):
            build_optimizer(OptimSection(name="lamb", lr=1e-3), model, impl="apex")


# ---- schedule -------------------------------------------------------------------------


def test_lr_hand_computed_values():
    kw = dict(base_lr=4.0, total_steps=10, warmup_steps=4)
    # Warm-up 0, 1, 2, 3 -> base * g / 4; then 4 * (1 - g/10); constant 0 past the end.
    assert [poly_lr_at(g, **kw) for g in range(13)] == pytest.approx(
        [0.0, 1.0, 2.0, 3.0, 2.4, 2.0, 1.6, 1.2, 0.8, 0.4, 0.0, 0.0, 0.0]
    )
    # start_warmup_step = -2: the ramp starts two steps in (w = g + 2); decay still from step 0.
    assert [poly_lr_at(g, start_warmup_step=-2, **kw) for g in range(4)] == pytest.approx([2.0, 3.0, 3.2, 2.8])
    # A positive start keeps the rate at 0 until the ramp begins.
    assert [poly_lr_at(g, start_warmup_step=3, **kw) for g in (0, 2, 3, 4, 7)] == pytest.approx(
        [0.0, 0.0, 0.0, 1.0, 1.2]
    )
    # No warm-up, power 2, end_lr 1: (4 - 1) * (1 - g/10)^2 + 1.
    assert [poly_lr_at(g, base_lr=4.0, total_steps=10, power=2.0, end_lr=1.0) for g in (0, 5, 10)] == pytest.approx(
        [4.0, 1.75, 1.0]
    )
    # The v2.0 8-GPU recipe: no warm-up, linear decay over 6700 steps from 4.25e-4.
    recipe = dict(base_lr=4.25e-4, total_steps=6700)
    assert poly_lr_at(0, **recipe) == 4.25e-4 and poly_lr_at(6700, **recipe) == 0.0
    assert math.isclose(poly_lr_at(3350, **recipe), 2.125e-4)


def test_scheduler_drives_the_optimizer_and_resumes():
    model = TinyNet()
    opt = build_optimizer(OptimSection(name="lamb", lr=1.0), model)
    sched = WarmupDecaySchedule(opt, OptimSection(lr=4.0, warmup_steps=4), max_steps=10)
    seen = []
    for _ in range(6):
        seen.append([g["lr"] for g in opt.param_groups])
        sched.step()
    assert all(a == b for a, b in seen)  # every group gets the rate
    assert [a for a, _ in seen] == pytest.approx([0.0, 1.0, 2.0, 3.0, 2.4, 2.0])
    state = sched.state_dict()
    other = WarmupDecaySchedule(
        build_optimizer(OptimSection(name="lamb", lr=1.0), TinyNet()),
        OptimSection(lr=4.0, warmup_steps=4),
        max_steps=10,
    )
    other.load_state_dict(state)
    assert other.last_lr == sched.last_lr == pytest.approx(1.6)
    assert all(g["lr"] == pytest.approx(1.6) for g in other.optimizer.param_groups)
    with pytest.raises(ValueError, match="end_lr"):  # the one value the config does not check
        WarmupDecaySchedule(opt, OptimSection(lr=1.0), max_steps=5, end_lr=2.0)


@pytest.mark.parametrize(
    "formula, kw",
    [
        (poly_lr_at, dict(base_lr=4.25e-4, total_steps=40, warmup_steps=7, start_warmup_step=-2, power=2.0)),
        (poly_lr_at, dict(base_lr=4.0, total_steps=10, warmup_steps=0, power=0.5, end_lr=1e-6)),
        (wsd_lr_at, dict(base_lr=8e-4, total_steps=40, warmup_steps=5, decay_steps=9, end_lr=1e-5)),
        (wsd_lr_at, dict(base_lr=8e-4, total_steps=40, warmup_steps=5, decay_steps=9, decay_shape="linear")),
        (wsd_lr_at, dict(base_lr=8e-4, total_steps=40, warmup_steps=0, decay_steps=0)),
    ],
)
def test_each_formula_gives_the_host_and_the_device_the_same_rate(formula, kw):
    """One expression serves an int step and a step tensor: every step's rate equal (past the end too) to
    the last bit, or, where a square root or a power is taken, within two bits of the peak rate (ULP_OF_A_ROOT)."""
    for step in range(50):
        host, dev = formula(step, **kw), formula(torch.tensor(step), **kw)
        assert isinstance(host, float) and dev.dtype == torch.float64, step
        assert abs(dev.item() - host) <= 2 * ULP_OF_A_ROOT * kw["base_lr"], step


# Python's math.sqrt and ** are libm's, correctly rounded; torch 2.13's CPU sqrt and pow of a float64
# tensor are not on every CPU (measured on a Xeon with AVX-512: torch.sqrt(8.0) is one bit below
# math.sqrt(8.0), at every ATEN_CPU_CAPABILITY). A root of a number up to 1 is then off by up to 2**-52,
# and the rate it scales by up to that much of the peak rate, plus the rate's own rounding.
ULP_OF_A_ROOT = 2.0**-52


# ---- the device-side skip (step(found_inf=...)) -----------------------------------------


def _optimizer(name, model, lr=0.02):
    return build_optimizer(OptimSection(name=name, lr=lr, weight_decay=0.01), model)


def _state(model, opt):
    return copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()["state"]})


def _steps(opt):
    """The step counts as floats: LAMB's per group, AdamW's per parameter."""
    if isinstance(opt, Lamb):
        return [float(g.get("step", 0)) for g in opt.param_groups]
    return [float(s["step"]) for s in opt.state.values()]


def _equal_states(a, b):
    flat_a, flat_b = torch.utils._pytree.tree_leaves(a), torch.utils._pytree.tree_leaves(b)
    return len(flat_a) == len(flat_b) and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(flat_a, flat_b)
    )


@pytest.mark.parametrize("name", ["lamb", "adamw", "stable_adamw"])
def test_found_inf_skips_bitwise_and_reads_nothing(name):
    """A flagged step leaves weights, moments and step counts bitwise; an unflagged one is the
    update itself; a run with skipped steps equals one that never saw them; the host reads
    neither the flag nor the device learning rate."""
    from tools.device_reads import DeviceReads

    torch.manual_seed(0)
    model = TinyNet()
    twin = copy.deepcopy(model)
    opt, twin_opt = _optimizer(name, model), _optimizer(name, twin)
    section = OptimSection(lr=0.02, warmup_steps=2)
    sched = WarmupDecaySchedule(opt, section, max_steps=20, device="cpu")
    twin_sched = WarmupDecaySchedule(twin_opt, section, max_steps=20, device="cpu")
    skipped = 0
    for step in range(6):
        bad = step in (1, 3)
        model.zero_grad(set_to_none=True)
        _loss(model, step).backward()
        if bad:  # what a non-finite step brings: NaN in one gradient, inf in another
            model.fc.weight.grad[0, 0] = float("nan")
            model.emb.weight.grad[1, 1] = float("inf")
        finite = torch.stack([torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None]).all()
        found_inf = ~finite
        before = _state(model, opt)
        counts = _steps(opt)
        with DeviceReads(list(model.parameters()) + [sched.lr, found_inf]) as reads:
            opt.step(found_inf=found_inf)
            sched.step(found_inf)
        assert reads.total == 0, reads.report()
        if bad:
            skipped += 1
            assert _equal_states(before, _state(model, opt)), step
            assert _steps(opt) == counts
        else:
            twin.zero_grad(set_to_none=True)
            _loss(twin, step).backward()
            twin_opt.step(found_inf=torch.tensor(False))
            twin_sched.step(torch.tensor(False))
            assert _equal_states(_state(twin, twin_opt), _state(model, opt)), step
    assert sched.step_count == 6 - skipped == twin_sched.step_count
    assert _steps(opt) == [6.0 - skipped] * len(_steps(opt))


def test_lamb_found_inf_false_is_todays_update_bitwise():
    torch.manual_seed(2)
    a = TinyNet()
    b = copy.deepcopy(a)
    opt_a, opt_b = Lamb(param_groups_for(a, 0.01), lr=0.02), Lamb(param_groups_for(b, 0.01), lr=0.02)
    for step in range(3):
        for m in (a, b):
            m.zero_grad()
            _loss(m, step).backward()
        opt_a.step()
        opt_b.step(found_inf=torch.zeros((), dtype=torch.bool))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)
    for sa, sb in zip(opt_a.state.values(), opt_b.state.values()):
        assert torch.equal(sa["exp_avg"], sb["exp_avg"]) and torch.equal(sa["exp_avg_sq"], sb["exp_avg_sq"])


def test_adamw_device_path_matches_torch():
    """The no-read path (tensor lr, found_inf) against torch's own AdamW step."""
    torch.manual_seed(3)
    a = TinyNet().double()
    b = copy.deepcopy(a)
    opt_a = torch.optim.AdamW(param_groups_for(a, 0.1), lr=0.01, betas=(0.8, 0.99), eps=1e-8)
    opt_b = build_optimizer(OptimSection(name="adamw", lr=0.01, betas=(0.8, 0.99), eps=1e-8, weight_decay=0.1), b)
    for step in range(5):
        for m in (a, b):
            m.zero_grad()
            _loss(m, step).backward()
        opt_a.step()
        for g in opt_b.param_groups:
            g["lr"] = torch.tensor(0.01, dtype=torch.float64)
        opt_b.step(found_inf=torch.tensor(0.0))
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-12, atol=1e-14)


def test_device_schedule_equals_host_schedule():
    section = OptimSection(lr=4.25e-4, warmup_steps=7, start_warmup_step=-2, poly_power=2.0)

    def sched(**kw):
        return WarmupDecaySchedule(build_optimizer(OptimSection(lr=1.0), TinyNet()), section, 30, end_lr=1e-6, **kw)

    host, dev = sched(), sched(device="cpu")
    for _ in range(35):
        assert dev.lr.item() == host.optimizer.param_groups[0]["lr"]  # bitwise: same double operations
        assert all(g["lr"] is dev.lr for g in dev.optimizer.param_groups)
        host.step()
        dev.step(torch.tensor(False))
    other = sched(device="cpu")
    other.load_state_dict(dev.state_dict())
    assert other.step_count == 35 and other.lr.item() == host.last_lr
    with pytest.raises(ValueError, match="found_inf"):
        host.step(torch.tensor(True))


def test_apply_update_reads_the_flag_only_for_an_optimizer_that_cannot_skip_on_the_device():
    """apex's FusedLAMB stand-in (torch's SGD, whose step takes no found_inf) with a host schedule: the host
    reads found_inf and skips the update and the schedule; Lamb with a device schedule reads nothing."""
    from bert.optim.optimizers import apply_update
    from tools.device_reads import DeviceReads

    model = TinyNet()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    host_sched = WarmupDecaySchedule(sgd, OptimSection(lr=0.1), max_steps=10)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    before = copy.deepcopy(model.state_dict())
    apply_update(sgd, host_sched, torch.tensor(True))
    assert host_sched.step_count == 0 and all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    apply_update(sgd, host_sched, torch.tensor(False))
    assert host_sched.step_count == 1 and not torch.equal(before["fc.weight"], model.fc.weight)

    lamb = _optimizer("lamb", model)
    sched = WarmupDecaySchedule(lamb, OptimSection(lr=0.02), max_steps=10, device="cpu")
    with DeviceReads(list(model.parameters()) + [sched.lr]) as reads:
        apply_update(lamb, sched, torch.isfinite(model.fc.weight.grad).all().logical_not())
    assert reads.total == 0 and sched.step_count == 1
