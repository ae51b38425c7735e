"""train.fp8: the encoder's linear layers in FP8 (torchao's float8 training, dynamic scaling),
on the CPU, where ``torch._scaled_mm`` runs ATen's reference FP8 GEMM.

The bound for one FP8 GEMM against fp32, norm-wise relative error per tensor: FP8 rounds
each operand to 3 mantissa bits (e4m3, unit roundoff 2^-4) or 2 (e5m2, 2^-3), so a product
of two e4m3 operands carries about sqrt(2) x 2^-4 / sqrt(3) ~ 5% relative noise: the output
(e4m3 x e4m3) is within 6%, the gradients (tensorwise: an e5m2 gradient; rowwise: e4m3 with
power-of-two scales) within 10%. And at least 1%: a bf16 GEMM (2^-9) would be far below, so
the test also shows that the FP8 path ran.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

from bert.config import load_config
from bert.model import fp8
from bert.model.config import BertConfig
from bert.model.pretraining import BertForPreTraining
from bert.train.trainer import Trainer
from common.errors import ConfigError
from launch.distributed import init_distributed
from tests.batches import random_batch, write_learnable_dataset
from tests.bert.train.test_trainer import dataset, losses, overrides, run_in_process  # noqa: F401 (a fixture)


@pytest.fixture(autouse=True)
def fp8_gemms_off_onednn():
    """ATen's own FP8 GEMM, not oneDNN's: on a Xeon with AMX, oneDNN's takes over a second for a
    320 x 128 x 512 product once bf16 autocast has run in the process (1-4 ms with it off; torch 2.13,
    docs/fp8.md). The launched ranks run fp32, where ATEN_CPU_CAPABILITY serves (tests/conftest.py)."""
    with torch.backends.mkldnn.flags(enabled=False):
        yield


BOUND = {"y": 0.06, "dx": 0.10, "dw": 0.10}
SHAPES = [(1, 16, 32), (37, 48, 80), (97, 128, 384), (511, 64, 16)]  # (N tokens, C in, O out); N never 16-aligned


class OneLayer(nn.Module):
    def __init__(self, c, o):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(c, o)])


def rel(a, b):
    return float((a.detach().float() - b.detach()).norm() / b.detach().norm())


@pytest.mark.parametrize("recipe", fp8.RECIPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_linear_forward_and_backward_within_fp8_error(recipe, shape):
    n, c, o = shape
    torch.manual_seed(n)
    ref = nn.Linear(c, o)
    wrapped = OneLayer(c, o)
    wrapped.layers[0].load_state_dict(ref.state_dict())
    assert fp8.convert_encoder(wrapped, recipe) == ["layers.0"]
    lin = wrapped.layers[0]
    assert fp8.is_fp8(lin)
    x, dy = torch.randn(n, c), torch.randn(n, o)
    xr, xf = x.clone().requires_grad_(), x.clone().requires_grad_()
    ref(xr).backward(dy)
    y = lin(xf)
    y.backward(dy)
    errors = {
        "y": rel(y.detach(), ref(x).detach()),
        "dx": rel(xf.grad, xr.grad),
        "dw": rel(lin.weight.grad, ref.weight.grad),
    }
    for key, err in errors.items():
        assert 0.01 <= err <= BOUND[key], f"{recipe} {shape} {key}: relative error {err:.4f}"
    torch.testing.assert_close(lin.bias.grad, ref.bias.grad)  # the bias is added in full precision


def test_every_gemm_of_a_converted_layer_is_a_scaled_mm():
    wrapped = OneLayer(48, 80)
    fp8.convert_encoder(wrapped, "tensorwise")
    x = torch.randn(37, 48, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        wrapped.layers[0](x).sum().backward()
    events = prof.events()
    assert [e.name for e in events].count("aten::_scaled_mm") == 3  # output, input gradient, weight gradient
    # Every other GEMM is either the dispatch of one of those (an mm on torchao's FP8 tensor
    # subclass) or the fp32 product inside ATen's CPU _scaled_mm, which multiplies the
    # dequantised FP8 operands (the numbers of an FP8 GEMM with fp32 accumulation).
    for e in events:
        if e.name in ("aten::mm", "aten::addmm", "aten::linear"):
            inside = e.cpu_parent is not None and e.cpu_parent.name == "aten::matmul"
            assert inside or [c.name for c in e.cpu_children] == ["PythonSubclass"], e.name


def test_only_the_encoder_linears_are_converted_and_the_state_dict_is_unchanged():
    config = BertConfig.preset("tiny", vocab_size=96)
    plain = BertForPreTraining(config)
    model = BertForPreTraining(config)
    model.load_state_dict(plain.state_dict())
    names = fp8.convert_encoder(model, "rowwise")
    assert names == [f"layers.{i}.{n}" for i in range(2) for n in ("qkv", "attn_out", "ffn_in", "ffn_out")]
    for name, m in model.named_modules():
        if isinstance(m, nn.Linear):
            assert fp8.is_fp8(m) == (name in names), name  # pooler, MLM transform, NSP stay as they were
    assert not fp8.is_fp8(model.embeddings.word)
    ours, theirs = model.state_dict(), plain.state_dict()
    assert list(ours) == list(theirs)
    assert all(torch.equal(ours[k], theirs[k]) and ours[k].dtype == torch.float32 for k in ours)


def test_the_bias_free_gemm_of_the_fused_path_is_fp8():
    wrapped = OneLayer(48, 80)
    plain = nn.Linear(48, 80)
    plain.load_state_dict(wrapped.layers[0].state_dict())
    fp8.convert_encoder(wrapped, "tensorwise")
    x = torch.randn(37, 48)
    lin = wrapped.layers[0]
    torch.testing.assert_close(fp8.matmul(lin, x) + lin.bias, lin(x))
    assert fp8.matmul(plain, x).equal(torch.nn.functional.linear(x, plain.weight))
    assert 0.01 <= rel(fp8.matmul(lin, x), torch.nn.functional.linear(x, plain.weight)) <= BOUND["y"]


def test_fused_ops_run_their_gemms_in_fp8():
    """model.fused_ops (Triton epilogues, in the interpreter) after FP8 GEMMs: the same numbers
    as the eager FP8 layers up to fp32 rounding, and far from the model without FP8."""
    config = BertConfig.preset("tiny", vocab_size=96, num_hidden_layers=1, hidden_dropout_prob=0.0)
    batch = random_batch([5, 17, 33], 96, seed=3)
    out = {}
    for name, fused, recipe in (("eager", False, "tensorwise"), ("fused", True, "tensorwise"), ("plain", True, "off")):
        torch.manual_seed(0)
        model = BertForPreTraining(config, fused_ops=fused)
        fp8.convert_encoder(model, recipe)
        logits = model(batch).mlm_logits
        logits.square().mean().backward()
        out[name] = (logits.detach(), model.layers[0].ffn_out.weight.grad)
    for i in range(2):
        torch.testing.assert_close(out["fused"][i], out["eager"][i], rtol=1e-4, atol=1e-5)
        assert rel(out["fused"][i], out["plain"][i]) >= 1e-3  # the fused path did not skip FP8


def test_bf16_autocast_on_the_cpu_reaches_the_fp8_layers():
    wrapped = OneLayer(48, 80)
    fp8.convert_encoder(wrapped, "tensorwise")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert wrapped.layers[0](torch.randn(5, 48)).dtype == torch.bfloat16


def test_an_fp8_layer_compiles_to_one_graph_under_autocast():
    wrapped = OneLayer(48, 80)
    fp8.convert_encoder(wrapped, "tensorwise")
    compiled = torch.compile(wrapped.layers[0], backend="aot_eager", fullgraph=True)  # a graph break would raise
    x = torch.randn(37, 48, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got, want = compiled(x), wrapped.layers[0](x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    got.float().sum().backward()
    assert x.grad.shape == x.shape


def test_sizes_fp8_cannot_run_and_bad_choices_are_config_errors():
    with pytest.raises(ConfigError, match=r"layers.0 is 40 -> 80; FP8 GEMMs need both sizes to be multiples of 16"):
        fp8.convert_encoder(OneLayer(40, 80), "tensorwise")
    with pytest.raises(ConfigError, match="train.fp8: 'blockwise' is not one of"):
        load_config(None, ["train.fp8=blockwise"])
    with pytest.raises(ConfigError, match="model.bias_gelu: epilogue is a bf16/fp32 GEMM"):
        load_config(None, ["train.fp8=tensorwise", "model.bias_gelu=epilogue"])
    assert fp8.convert_encoder(OneLayer(40, 80), "off") == []  # off converts nothing, so checks nothing


@pytest.mark.parametrize("recipe", fp8.RECIPES)
def test_fp8_is_allowed_in_the_closed_division(recipe):
    # NVIDIA's closed BERT submissions train in FP8 since v3.0: the rules allow it.
    from tests.bert.report.test_closed_division import CLOSED

    cfg = load_config(None, CLOSED + [f"train.fp8={recipe}", "model.bias_gelu=triton"])
    assert cfg.log.division == "closed" and cfg.train.fp8 == recipe


def test_a_model_fp8_cannot_run_is_a_one_line_config_error(dataset, tmp_path):  # noqa: F811
    from tests.bert.train.test_trainer import cli

    config = {"vocab_size": 96, "hidden_size": 40, "num_hidden_layers": 1, "num_attention_heads": 2}
    (tmp_path / "bert_config.json").write_text(json.dumps({**config, "intermediate_size": 80}))
    r = cli(
        "--output-dir",
        str(tmp_path / "out"),
        *overrides(dataset, "train.fp8=tensorwise", f"model.config_file={tmp_path / 'bert_config.json'}"),
    )
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert "train.fp8: layers.0.qkv is 40 -> 120; FP8 GEMMs need both sizes to be multiples of 16" in r.stderr


def test_the_mlperf_log_takes_the_rules_precision_names_once(tmp_path):
    from bert.report.mlperf_log import MLPerfLogger

    log = MLPerfLogger(tmp_path / "mlperf.log", 0, "open", submitter="tests", platform="1xCPU")
    log.init_start()
    with pytest.raises(ValueError, match="lowest_numerical_precision_in_linear must be one of"):
        log.precision(linear="e4m3", attention="bfloat16")
    log.precision(linear="fp8", attention="bfloat16")  # the refused call logged nothing
    with pytest.raises(RuntimeError, match="precision was already logged"):
        log.precision(linear="fp8", attention="bfloat16")
    log.close()
    logged = [json.loads(line.split(":::MLLOG ", 1)[1])["key"] for line in open(tmp_path / "mlperf.log")]
    assert logged.count("lowest_numerical_precision_in_linear") == 1


def test_mlperf_precision_names():
    assert fp8.mlperf_precision("tensorwise", "bf16") == "fp8"
    assert fp8.mlperf_precision("off", "bf16") == "bfloat16"
    assert fp8.mlperf_precision("off", "fp32") == "fp32"


@pytest.fixture(scope="module")
def learnable(tmp_path_factory):
    return write_learnable_dataset(str(tmp_path_factory.mktemp("learnable")))


def test_fp8_run_logs_its_precision_and_exports_the_weights_it_trained(dataset, tmp_path):  # noqa: F811
    from bert.checkpoint.export import export_run
    from bert.checkpoint.pretrained import load_pretrained
    from tests.bert.checkpoint.test_export import write_vocab

    vocab = write_vocab(tmp_path / "vocab.txt")
    cfg = load_config(
        None,
        overrides(
            dataset, "train.max_steps=3", "train.fp8=tensorwise", "checkpoint.at_end=true", f"data.vocab_file={vocab}"
        ),
    )
    trainer = Trainer(cfg, str(tmp_path / "run"), init_distributed(backend="gloo"))
    trainer.train()
    events = [json.loads(line.split(":::MLLOG ", 1)[1]) for line in open(tmp_path / "run" / "mlperf.log")]
    logged = {e["key"]: e["value"] for e in events}
    assert logged["lowest_numerical_precision_in_linear"] == "fp8"
    assert logged["lowest_numerical_precision_in_attn"] == "fp32"
    export_run(str(tmp_path / "run"), str(tmp_path / "hf"))
    back = BertForPreTraining(trainer.model_config)
    load_pretrained(back, str(tmp_path / "hf"))
    trained = trainer.model.state_dict()
    for key, value in back.state_dict().items():
        assert value.dtype == torch.float32 and torch.equal(value, trained[key]), key  # full precision, bit for bit


@pytest.mark.slow  # three short training runs
def test_fp8_resume_is_bitwise_identical(learnable, tmp_path):
    run_in_process(learnable, tmp_path / "whole", "train.max_steps=4", "train.fp8=rowwise")
    first = run_in_process(learnable, tmp_path / "parts", "train.max_steps=4", "train.fp8=rowwise", stop_after=1)
    assert first["status"] == "interrupted" and first["steps"] == 2
    run_in_process(learnable, tmp_path / "parts", "train.max_steps=4", "train.fp8=rowwise")
    assert losses(tmp_path / "parts") == losses(tmp_path / "whole")  # dynamic scaling keeps no state


DEMO_200 = [
    "train.max_steps=200",
    "train.precision=bf16",
    "train.log_interval_steps=20",
    "eval.interval_samples=1600",  # once, at the end (200 steps x 8 sequences)
    "eval.batch_size=50",
    "optim.lr=8e-3",
    "optim.warmup_steps=20",
]


@pytest.mark.slow  # two 200-step runs
def test_200_steps_of_fp8_match_bf16(learnable, tmp_path):
    with torch.backends.mkldnn.flags(enabled=True):  # no FP8 GEMM in it: oneDNN's bf16 GEMMs are the fast ones
        bf16 = run_in_process(learnable, tmp_path / "bf16", *DEMO_200)
    ours = run_in_process(learnable, tmp_path / "fp8", *DEMO_200, "train.fp8=tensorwise")
    final_bf16, final_fp8 = losses(tmp_path / "bf16")[-1], losses(tmp_path / "fp8")[-1]
    accuracy = f"accuracy bf16 {bf16['eval_accuracy']:.4f} fp8 {ours['eval_accuracy']:.4f}"
    print(f"{accuracy}; final loss {final_bf16:.4f} {final_fp8:.4f}")
    # Chance is 1/91 (0.011); bf16 reached 0.131 when written.
    assert bf16["eval_accuracy"] > 0.1  # the model learned, so the comparison means something
    assert abs(ours["eval_accuracy"] - bf16["eval_accuracy"]) <= 0.01
    assert abs(final_fp8 - final_bf16) <= 0.02 * final_bf16


@pytest.mark.slow  # FP8 split into micro-batches, and a compiled FP8 model
def test_fp8_with_grad_accumulation_and_torch_compile(learnable, tmp_path):
    run_in_process(learnable, tmp_path / "a", "train.max_steps=3", "train.fp8=tensorwise")
    run_in_process(learnable, tmp_path / "b", "train.max_steps=3", "train.fp8=tensorwise", "train.grad_accum_steps=4")
    # Scales are per micro-batch GEMM, so the split changes FP8's rounding, not the math.
    assert losses(tmp_path / "b") == pytest.approx(losses(tmp_path / "a"), rel=2e-3)

    torch.manual_seed(0)
    config = BertConfig.preset("tiny", vocab_size=96, num_hidden_layers=1)
    eager = BertForPreTraining(config).eval()
    fp8.convert_encoder(eager, "tensorwise")
    compiled = torch.compile(eager, backend="aot_eager")
    for lengths in ([3, 40, 17], [9, 33, 5, 28]):
        batch = random_batch(lengths, 96, seed=len(lengths))
        want, got = eager(batch).mlm_logits, compiled(batch).mlm_logits
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        grads = [torch.autograd.grad(out.square().mean(), eager.layers[0].ffn_in.weight)[0] for out in (want, got)]
        torch.testing.assert_close(grads[1], grads[0], rtol=1e-5, atol=1e-6)


@pytest.mark.multiprocess
@pytest.mark.slow  # torchrun with 2 ranks, and three single-process runs
def test_two_rank_fp8_equals_one_rank_within_fp8s_spread(learnable, tmp_path):
    from tests.bert.train.test_trainer_distributed import launch

    steps = ["train.max_steps=5", "train.fp8=tensorwise", "data.rebalance=none"]
    run_in_process(learnable, tmp_path / "one", *steps)
    run_in_process(learnable, tmp_path / "accum", *steps, "train.grad_accum_steps=2")
    launch("run_torchrun.sh", 2, tmp_path / "two", learnable, *steps)
    one, accum, two = (losses(tmp_path / d) for d in ("one", "accum", "two"))
    # FP8's own spread: the same global batch split in two micro-batches, each with its scales
    # (what two ranks do), against one micro-batch. Two ranks must stay within it.
    spread = max(abs(a - b) for a, b in zip(accum, one))
    assert len(two) == len(one) == 5
    assert max(abs(a - b) for a, b in zip(two, one)) <= 2 * spread + 1e-6


@pytest.mark.gpu
def test_fp8_gemm_kernels_run_on_the_gpu():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) < (8, 9):
        pytest.skip(f"FP8 GEMMs need compute capability 8.9+, this GPU is {major}.{minor}")
    pytest.importorskip("torchao", reason="train.fp8 needs torchao (on the GPU machine: make gpu-bundle)")
    wrapped = OneLayer(1024, 4096).cuda()
    fp8.convert_encoder(wrapped, "tensorwise", device=torch.device("cuda"))
    x = torch.randn(14003, 1024, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        wrapped.layers[0](x).float().sum().backward()  # warm-up
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            wrapped.layers[0](x).float().sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events()]
    assert names.count("aten::_scaled_mm") == 3
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    fp8_kernels = [k for k in kernels if any(s in k.lower() for s in ("e4m3", "e5m2", "f8", "fp8"))]
    assert len(fp8_kernels) >= 3, kernels


@pytest.mark.gpu
def test_fp8_and_bf16_train_steps_on_the_gpu(tmp_path):
    """Both settings of bench/fp8.py's training step run (the times are the bench's to report)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need compute capability 8.9+")
    pytest.importorskip("torchao", reason="train.fp8 needs torchao (on the GPU machine: make gpu-bundle)")
    from bench import fp8 as bench_fp8

    out = tmp_path / "fp8.json"
    assert bench_fp8.main(["--parts", "train_step", "--layers", "2", "--steps", "3", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]["train_step"]
    assert all(results[r]["status"] == "ok" and results[r]["step_s"] > 0 for r in ("off", "tensorwise", "rowwise"))


def test_cpu_bench_checks_fp8_and_the_epilogue(tmp_path):
    from bench import fp8 as bench_fp8

    out = tmp_path / "fp8.json"
    assert bench_fp8.main(["--parts", "ffn_in,gemm", "--json", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert set(results["ffn_in"]) == {"eager", "triton", "epilogue"}
    assert all(r["status"] == "ok" for r in results["ffn_in"].values())
    assert all(results["gemm"]["small"][r]["status"] == "ok" for r in ("tensorwise", "rowwise"))
