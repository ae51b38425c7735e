"""ModernBERT's recipe items beyond AdamW and WSD: StableAdamW against torch-optimi's (an
implementation nobody here wrote), and the batch-size warm-up: its sizes per step, a run that
follows it, a bitwise resume inside it, and its one-line config errors."""

import copy
import json
import math

import pytest
import torch

from bert.config import OptimSection, load_config
from bert.optim.optimizers import build_optimizer, param_groups_for
from common.errors import ConfigError, DataError
from data.batch_ramp import BatchRamp
from tests.batches import write_learnable_dataset
from tests.bert.optim.test_optimizers import TinyNet, _loss
from tests.bert.train.test_modernbert_training import MODERN, records
from tests.bert.train.test_trainer import cli, dataset, losses, overrides, run_in_process  # noqa: F401 (dataset is a fixture)
from tests.helpers import REPO

# ---- StableAdamW ---------------------------------------------------------------------------

# optimi warns that 0.1 is a large fully decoupled weight decay: large on purpose, see below.
pytestmark = pytest.mark.filterwarnings("ignore:You are using weight_decay:UserWarning")


def _optimi_pair(dtype, name="stable_adamw", decouple_lr=False, wd=0.1, betas=(0.9, 0.98), eps=1e-6, lr=0.02):
    optimi = pytest.importorskip("optimi", reason="torch-optimi (requirements-dev.txt) is not installed")
    torch.manual_seed(0)
    ours_model = TinyNet().to(dtype)
    theirs_model = copy.deepcopy(ours_model)
    section = OptimSection(name=name, lr=lr, betas=betas, eps=eps, weight_decay=wd, decouple_lr=decouple_lr)
    ours = build_optimizer(section, ours_model)
    # optimi's settings written out: its decouple_lr (weight decay lr_t x wd as torch's AdamW, or
    # lr_t / max_lr x wd with max_lr = lr, its default), plain sums, the per-tensor for-loop path.
    kind = optimi.StableAdamW if name == "stable_adamw" else optimi.AdamW
    theirs = kind(
        param_groups_for(theirs_model, wd),
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=wd,
        decouple_lr=decouple_lr,
        kahan_sum=False,
        foreach=False,
        triton=False,
    )
    return (ours_model, ours), (theirs_model, theirs)


def _spiky_steps(models, step):
    """The gradients of ``step``, with a 50x spike in one tensor at step 4 so that StableAdamW's clipping acts."""
    for m in models:
        m.zero_grad(set_to_none=True)
        _loss(m, step).backward()
        if step == 4:
            m.fc.weight.grad.mul_(50)


@pytest.mark.parametrize("decouple_lr", [False, True])
@pytest.mark.parametrize("dtype, atol", [(torch.float32, 1e-6), (torch.float64, 1e-13)])
def test_stable_adamw_matches_optimi(dtype, atol, decouple_lr):
    """Eight steps, one with a gradient spike; optimi keeps bias-corrected moments and ours
    torch's raw ones, so the two agree to rounding, not bitwise. A large weight decay (0.1)
    makes the two decay conventions differ by far more than the tolerance."""
    (ours_model, ours), (theirs_model, theirs) = _optimi_pair(dtype, decouple_lr=decouple_lr)
    plain_model = copy.deepcopy(ours_model)
    section = OptimSection(
        name="adamw", lr=0.02, betas=(0.9, 0.98), eps=1e-6, weight_decay=0.1, decouple_lr=decouple_lr
    )
    plain = build_optimizer(section, plain_model)
    for step in range(8):
        _spiky_steps((ours_model, theirs_model, plain_model), step)
        ours.step()
        theirs.step()
        plain.step()
        for (name, p), q in zip(ours_model.named_parameters(), theirs_model.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=atol, msg=f"step {step}: {name}")
    # The clipping changed the trajectory: AdamW without it is far from both.
    assert max((p - q).abs().max().item() for p, q in zip(ours_model.parameters(), plain_model.parameters())) > 1e-3


def test_adamw_decouple_lr_matches_optimi():
    """optim.decouple_lr with plain AdamW against optimi's AdamW(decouple_lr=True)."""
    (ours_model, ours), (theirs_model, theirs) = _optimi_pair(torch.float64, name="adamw", decouple_lr=True)
    for step in range(6):
        _spiky_steps((ours_model, theirs_model), step)
        ours.step()
        theirs.step()
    for p, q in zip(ours_model.parameters(), theirs_model.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-13)


def test_stable_adamw_device_path_matches_its_host_path():
    """A device-tensor learning rate and found_inf=False (the trainer's path) give the plain step bitwise."""
    (a, opt_a), _ = _optimi_pair(torch.float32)
    b = copy.deepcopy(a)
    opt_b = build_optimizer(OptimSection(name="stable_adamw", lr=0.02, betas=(0.9, 0.98), weight_decay=0.1), b)
    for step in range(4):
        for m in (a, b):
            m.zero_grad()
            _loss(m, step).backward()
        opt_a.step()
        for g in opt_b.param_groups:
            g["lr"] = torch.tensor(0.02, dtype=torch.float64)  # as bert.optim.schedule keeps it on the device
        opt_b.step(found_inf=torch.tensor(False))
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_stable_adamw_state_dict_resume_is_bitwise():
    (a, opt_a), _ = _optimi_pair(torch.float32)
    for step in range(3):
        a.zero_grad()
        _loss(a, step).backward()
        opt_a.step()
    b = copy.deepcopy(a)
    opt_b = build_optimizer(OptimSection(name="stable_adamw", lr=0.02, betas=(0.9, 0.98), weight_decay=0.1), b)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))
    for step in range(3, 5):
        for m, o in ((a, opt_a), (b, opt_b)):
            m.zero_grad()
            _loss(m, step).backward()
            o.step()
    for p, q in zip(a.parameters(), b.parameters()):
        assert torch.equal(p, q)


def test_stable_adamw_refuses_optim_shard_and_lamb_refuses_decouple_lr():
    with pytest.raises(
        ConfigError, match=r"optim.shard: sharding runs LAMB \(optim.name=lamb\), got optim.name='stable_adamw'"
    ):
        OptimSection(name="stable_adamw", shard="dp")
    with pytest.raises(ConfigError, match="optim.decouple_lr: applies to adamw and stable_adamw"):
        OptimSection(name="lamb", decouple_lr=True)


# ---- batch-size warm-up: the ramp ------------------------------------------------------------


def test_ramp_sizes_per_step():
    ramp = BatchRamp(unit=2, start=1, full=4, steps=6)
    assert [ramp.units(s) for s in range(9)] == [1, 1, 2, 2, 3, 3, 4, 4, 4]
    assert [ramp.batch_size(s) for s in range(9)] == [2, 2, 4, 4, 6, 6, 8, 8, 8]
    # Uneven splits: sizes never shrink, each is held floor or ceil of steps / sizes steps.
    for ramp in (BatchRamp(3, 2, 7, 11), BatchRamp(768, 1, 6, 21192), BatchRamp(5, 1, 2, 1)):
        units = [ramp.units(s) for s in range(ramp.steps + 3)]
        assert units[0] == ramp.start and units[ramp.steps] == ramp.full and units == sorted(units)
        held = [units.count(k) for k in range(ramp.start, ramp.full)]
        assert max(held) - min(held) <= 1 and sum(held) == ramp.steps
        # The sample position at each step, derived in closed form, is the sum of the sizes so far.
        for s in list(range(ramp.steps + 3)) if ramp.steps < 100 else [0, 1, 4238, 4239, 12000, 21191, 21192, 30000]:
            assert ramp.units_before(s) == sum(ramp.units(i) for i in range(s)), (ramp, s)
    # ModernBERT-base's: 768 to 4,608 sequences, 768 (one micro-batch of 96 on each of 8 GPUs) at a time.
    mb = BatchRamp(768, 1, 6, 21192)
    assert {mb.batch_size(s) for s in range(30000)} == {768, 1536, 2304, 3072, 3840, 4608}
    with pytest.raises(ValueError, match="BatchRamp"):
        BatchRamp(2, 4, 4, 6)


WARMUP = [
    "optim.name=stable_adamw",
    "train.grad_accum_steps=4",  # global batch 8: units of 2 sequences
    "train.batch_size_warmup=[2,6]",
]


def _per_step_sequences(out_dir):
    samples = [r["samples"] for r in records(out_dir) if "loss" in r]
    return [b - a for a, b in zip([0, *samples], samples)]


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    return write_learnable_dataset(str(tmp_path_factory.mktemp("learnable")))


def test_warmup_run_follows_the_ramp_and_trains(learnable, tmp_path):
    """16 steps with StableAdamW on data whose masked tokens can be learned (a repeated motif):
    the sequences per step follow the ramp (2, 4, 6 sequences for 2 steps each, then the full 8),
    and the loss falls."""
    run = [*MODERN, *WARMUP, "train.max_steps=16", "optim.lr=5e-3", "optim.decay_steps=0", "eval.interval_samples=1000"]
    summary = run_in_process(learnable, tmp_path, *run)
    assert summary["status"] == "aborted" and summary["steps"] == 16 and summary["samples"] == 104
    assert _per_step_sequences(tmp_path) == [2, 2, 4, 4, 6, 6] + [8] * 10
    loss = losses(tmp_path)
    assert all(math.isfinite(x) for x in loss)
    assert sum(loss[-4:]) / 4 < sum(loss[:4]) / 4 - 0.2, loss


def test_resume_inside_the_ramp_is_bitwise(dataset, tmp_path):  # noqa: F811
    run = [*MODERN, *WARMUP, "train.max_steps=8"]
    run_in_process(dataset, tmp_path / "whole", *run)
    first = run_in_process(dataset, tmp_path / "parts", *run, stop_after=2)
    assert first["status"] == "interrupted" and first["steps"] == 3  # stopped at 4 sequences a step, mid-ramp
    second = run_in_process(dataset, tmp_path / "parts", *run)
    assert second["steps"] == 8
    assert losses(tmp_path / "parts") == losses(tmp_path / "whole")
    assert _per_step_sequences(tmp_path / "parts") == _per_step_sequences(tmp_path / "whole")
    with open(tmp_path / "parts" / "summary.json") as f:
        assert json.load(f)["samples"] == 40


def test_resume_with_another_ramp_is_refused(dataset, tmp_path):  # noqa: F811
    """The saved position counts the old ramp's steps: resuming under another ramp is a one-line
    DataError (run_pretraining prints it and exits 2), not a silent jump to other samples."""
    run_in_process(dataset, tmp_path, *MODERN, *WARMUP, "train.max_steps=6", stop_after=1)
    with pytest.raises(DataError) as e:
        run_in_process(dataset, tmp_path, *MODERN, *WARMUP, "train.batch_size_warmup=[2,3]", "train.max_steps=6")
    assert "loader state: batch-size warm-up" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["train.batch_size_warmup=[3,6]"], "train.batch_size_warmup: start 3 is not a multiple of"),
        (["train.batch_size_warmup=[8,6]"], "start 8 must lie in [1, train.global_batch_size 8)"),
        (["train.batch_size_warmup=[0,6]"], "train.batch_size_warmup: start 0 must lie in"),
        (["train.batch_size_warmup=[2,0]"], "train.batch_size_warmup: steps must be >= 1"),
        (["train.batch_size_warmup=[2]"], "train.batch_size_warmup: expected a list of 2 values"),
        (
            ["log.division=closed", "log.submitter=x", "optim.name=lamb"],
            "train.batch_size_warmup: the closed division",
        ),
    ],
)
def test_bad_warmup_config_is_named(dataset, extra, message):  # noqa: F811
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides(dataset, *WARMUP, *extra))
    assert message in str(e.value) and "\n" not in str(e.value)


def test_bad_warmup_config_is_one_line_exit_2(dataset, tmp_path):  # noqa: F811
    r = cli("--output-dir", str(tmp_path / "out"), *overrides(dataset, *WARMUP, "train.batch_size_warmup=[3,6]"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and "train.batch_size_warmup: start 3" in r.stderr


def test_recipe_config_sets_both():
    cfg = load_config(str(REPO / "launch" / "configs" / "modernbert_base_8gpu.yaml"), [])
    assert cfg.optim.name == "stable_adamw" and cfg.optim.decouple_lr
    assert (cfg.train.batch_size_warmup, cfg.train.global_batch_size) == ((768, 21192), 4608)


@pytest.mark.multiprocess
@pytest.mark.slow  # torchrun, 2 ranks
def test_two_ranks_with_the_ramp_and_rebalancing_match_one_rank(dataset, tmp_path):  # noqa: F811
    """Every rank takes its share of each ramp step (the rebalancer's exchange sized by the step)."""
    from tests.bert.train.test_trainer_distributed import STEPS, launch

    run_in_process(dataset, tmp_path / "one", *STEPS, *MODERN, *WARMUP)
    launch("run_torchrun.sh", 2, tmp_path / "two", dataset, *MODERN, *WARMUP, "data.rebalance=balanced")
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert len(one) == len(two) == 5
    assert two == pytest.approx(one, rel=1e-5)
    assert _per_step_sequences(tmp_path / "two") == _per_step_sequences(tmp_path / "one") == [2, 2, 4, 4, 6]


def test_static_shapes_under_the_ramp_train_the_same_losses(dataset, tmp_path):  # noqa: F811
    """A ramp step runs k micro-batches of the usual shape: train.static_shapes pads them to its
    buckets as without the ramp (the shapes a CUDA graph would capture), and the losses stay."""
    run = [*MODERN, *WARMUP, "train.max_steps=8", "eval.interval_samples=100000"]
    dynamic = run_in_process(dataset, tmp_path / "dynamic", *run)
    static = run_in_process(dataset, tmp_path / "static", *run, "train.static_shapes=true")
    a, b = losses(tmp_path / "dynamic"), losses(tmp_path / "static")
    assert len(a) == len(b) == 8
    assert max(abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b)) <= 1e-6
    assert static["distinct_shapes"] < dynamic["distinct_shapes"]
    assert _per_step_sequences(tmp_path / "static") == [2, 2, 4, 4, 6, 6, 8, 8]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a CUDA GPU; none is available")
def test_cuda_graphs_under_the_ramp_train_the_same_losses(dataset, tmp_path):  # noqa: F811
    """On a GPU: the ramp's steps replay the graphs of the usual micro-batch shapes (fp32, no TF32)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    run = [*MODERN, *WARMUP, "train.max_steps=8", "eval.interval_samples=100000", "train.device=cuda"]
    run += ["train.static_shapes=true"]
    eager = run_in_process(dataset, tmp_path / "eager", *run)
    graphed = run_in_process(dataset, tmp_path / "graphed", *run, "train.cuda_graphs=true")
    a, b = losses(tmp_path / "eager"), losses(tmp_path / "graphed")
    assert len(a) == len(b) == 8 and eager["steps"] == graphed["steps"] == 8
    assert max(abs(x - y) / max(1.0, abs(x)) for x, y in zip(a, b)) <= 1e-5
    assert _per_step_sequences(tmp_path / "graphed") == [2, 2, 4, 4, 6, 6, 8, 8]
