"""The run configuration: one typed dataclass per component, loaded from YAML.

``load_config(path, overrides)`` reads ``launch/configs/*.yaml`` (a mapping of sections to
fields) and applies command-line overrides ``section.field=value`` (values parsed as YAML,
so ``optim.betas=[0.9,0.98]`` and ``checkpoint.init=null`` work; a string field, a path
for instance, takes the text after ``=`` as it is, so ``data.train_dir=/data/run #3`` or a
directory named ``2024``, ``yes`` or ``"quoted"`` is not read as YAML). Every field has its
default and its meaning here, once; ``describe()`` prints them for ``--help``. Unknown
sections or fields and invalid values raise ``ConfigError`` naming ``section.field`` and
the valid choices, before any work starts.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field, fields

import yaml

from bert.config import PRESETS, BertConfig
from bert.config import ConfigError as BertConfigError
from data.rebalance_plan import check_cost
from kernels import registry
from kernels.interface import PackedLayout, PaddedLayout, VarlenLayout

# data.layout -> the attention layout the model builds from such a batch.
ATTENTION_LAYOUTS = {"unpadded": VarlenLayout, "padded": PaddedLayout, "packed": PackedLayout}


class ConfigError(ValueError):
    """An invalid run configuration; the message names the key."""


def opt(default, help: str, choices: tuple | None = None):
    meta = {"help": help, "choices": choices}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


def _check(section: str, obj) -> None:
    """Choices and types of every field (called from each section's __post_init__)."""
    hints = typing.get_type_hints(type(obj))
    for f in fields(obj):
        key, value = f"{section}.{f.name}", getattr(obj, f.name)
        choices = f.metadata.get("choices")
        if choices is not None and value not in choices:
            raise ConfigError(f"{key}: {value!r} is not one of {list(choices)}")
        value = _coerce(key, value, hints[f.name])
        object.__setattr__(obj, f.name, value)


def _coerce(key: str, value, hint):
    if dataclasses.is_dataclass(hint):
        if isinstance(value, hint):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a mapping of fields, got {value!r}")
        valid = [f.name for f in fields(hint)]
        bad = sorted(set(value) - set(valid))
        if bad:
            raise ConfigError(f"{key}.{bad[0]}: unknown field; valid fields of {key}: {valid}")
        return hint(**value)
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        if str in inner and isinstance(value, str) and len(inner) > 1:
            return value  # a keyword such as eval.interval_samples=auto; the section checks which
        return _coerce(key, value, inner[0])
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected true or false, got {value!r}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected an integer, got {value!r}")
        return value
    if hint is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 (no decimal point) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected a number, got {value!r}")
        try:
            number = float(value)
        except OverflowError:  # an integer beyond float range
            number = math.inf
        if not math.isfinite(number):  # YAML's .nan and .inf would pass every range check below
            raise ConfigError(f"{key}: expected a finite number, got {value!r}")
        return number
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected a string, got {value!r}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            raise ConfigError(f"{key}: expected a list of {len(args)} values, got {value!r}")
        return tuple(_coerce(key, v, a) for v, a in zip(value, args))
    if origin is list:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        return [_coerce(key, v, args[0]) for v in value]
    return value


def _auto_or_positive(key: str, value, what: str) -> None:
    """A field that is ``auto`` or a positive integer."""
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(f"{key}: expected {what} or auto, got {value!r}")
    else:
        _positive(key, value)


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ConfigError(f"{key}: must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")


@dataclass
class ModelSection:
    preset: str = opt(
        "large",
        "architecture preset (bert.config.PRESETS): BERT's, or a ModernBERT-class encoder",
        ("tiny", "small", "base", "large", "modernbert_tiny", "modernbert_base", "modernbert_large"),
    )
    config_file: str | None = opt(None, "bert_config.json or transformers config.json; overrides preset")
    attention: str = opt(
        "reference",
        "attention backend (kernels.registry): "
        + "; ".join(
            f"{', '.join(registry.backends_for(lay))} ({kind} layout)" for kind, lay in ATTENTION_LAYOUTS.items()
        ),
        registry.BACKENDS.keys(),  # a live view: a backend registered later is a choice too
    )
    grouped_buckets: list[int] = opt(
        [128, 256, 384, 512],
        "triton_grouped: sequence-length buckets; each group of same-bucket sequences is one launch",
    )
    grouped_streams: int = opt(4, "triton_grouped: CUDA streams the groups are spread over")
    fused_ops: bool = opt(False, "fused Triton bias+GELU and bias+dropout+residual+LayerNorm (post-norm BERT)")
    bias_gelu: str = opt(
        "auto",
        "the FFN-in's bias+GELU: eager (GEMM with bias, then GELU), triton (GEMM, then the fused "
        "Triton kernel), epilogue (in the GEMM: cuBLASLt's GELU epilogue, tanh GELU on CUDA; "
        "docs/fp8.md); auto: triton with model.fused_ops, else eager",
        ("auto", "eager", "triton", "epilogue"),
    )
    rotary_kernel: str = opt(
        "torch", "rotary models: apply RoPE with the PyTorch reference or the Triton kernel", ("torch", "triton")
    )
    hidden_dropout_prob: float | None = opt(None, "override the architecture's hidden dropout")
    attention_probs_dropout_prob: float | None = opt(None, "override the architecture's attention dropout")
    vocab_size: int | None = opt(None, "override the architecture's vocabulary size (e.g. a trained vocab)")
    rope_theta_global: float | None = opt(
        None, "rotary models: override the global layers' theta (a context-extension phase sets a new one)"
    )
    rope_theta_local: float | None = opt(None, "rotary models: override the local (sliding-window) layers' theta")
    compile: bool = opt(False, "wrap the model in torch.compile")

    def __post_init__(self):
        _check("model", self)


@dataclass
class DataSection:
    train_dir: str = opt("", "directory of training shards (part_*.hdf5), fixed or varlength layout")
    eval_file: str = opt("", "the eval HDF5 file (MLPerf: 10,000 samples)")
    layout: str = opt(
        "unpadded",
        "batch layout fed to the model: unpadded (flat tokens, cu_seqlens), padded "
        "([B, max_seq_length], the baseline) or packed (rows of max_seq_length holding "
        "several whole sequences); model.attention names a backend that takes it",
        tuple(ATTENTION_LAYOUTS),
    )
    backend: str = opt("torch", "loader backend", ("torch", "dali"))
    max_seq_length: int = opt(512, "sequence length of the data; the padded layout pads to it")
    vocab_file: str | None = opt(None, "vocabulary the data was made with; sets the model's vocab_size")
    max_predictions_per_seq: int = opt(
        76,
        "masked positions per sequence at most (MLPerf data: 76); logged before "
        "the data is opened, then checked against it",
    )
    rebalance: str = opt(
        "balanced",
        "cross-rank sequence-length rebalancing each step (stripe: the MLPerf submissions' sort-and-stride; "
        "measured: balanced with the cost and a speed per rank fitted to measured step times)",
        ("none", "stripe", "balanced", "measured"),
    )
    rebalance_cost: tuple[float, float] = opt((1.0, 1.0 / 6144), "(a, b) of the per-sample cost a*L + b*L^2")
    rebalance_cost_local: tuple[float, int] = opt(
        (0.0, 0),
        "(b_local, window): the sliding-window layers' term b_local*L*min(L, window) of the cost "
        "(python -m bench.fit_cost fits it with a and b; (0, 0): no local layers)",
    )
    rebalance_measured: tuple[int, float, float] = opt(
        (32, 4.0, 0.1),
        "measured: (window: steps kept per rank, bound: the factor a fitted coefficient stays within "
        "of rebalance_cost's, rate: the largest relative change of a speed or coefficient per step)",
    )
    rebalance_group_size: int | None = opt(
        None, "hierarchical rebalancing in groups of this many ranks (e.g. GPUs per node, for thousands of ranks)"
    )
    on_corrupt: str = opt(
        "fail",
        "a training sample that fails validation or cannot be read: fail stops the run "
        "naming file and sample; skip replaces it by the next good sample of the "
        "epoch's stream and counts it (metrics corrupt_samples, summary)",
        ("fail", "skip"),
    )

    def __post_init__(self):
        _check("data", self)
        _positive("data.max_seq_length", self.max_seq_length)
        _positive("data.max_predictions_per_seq", self.max_predictions_per_seq)
        try:
            check_cost(self.rebalance_cost_tuple)
        except ValueError as e:
            raise ConfigError(
                f"data.rebalance_cost / data.rebalance_cost_local: {str(e).removeprefix('cost: ')}"
            ) from None
        window, bound, rate = got = self.rebalance_measured
        if window < 2 or not 1 <= bound < math.inf or not 0 < rate <= 1:
            raise ConfigError(f"data.rebalance_measured: expected window >= 2, bound >= 1, 0 < rate <= 1, got {got}")

    @property
    def rebalance_cost_tuple(self) -> tuple:
        """(a, b, b_local, window): ``data.rebalance_plan.Cost``'s fields, from both config keys."""
        return (*self.rebalance_cost, *self.rebalance_cost_local)


@dataclass
class TrainSection:
    global_batch_size: int = opt(448, "sequences per optimizer step, over all ranks")
    grad_accum_steps: int = opt(1, "micro-batches per optimizer step on each rank")
    max_steps: int = opt(6700, "stop (status aborted) after this many optimizer steps")
    max_samples: int = opt(4_500_000, "stop (status aborted) after this many training samples")
    seed: int | None = opt(
        None,
        "seeds data order, initialisation and dropout; unset (null): rank 0 draws "
        "one from the OS and broadcasts it, so each run has its own (MLPerf closed "
        "division); the seed used is logged and kept in checkpoints",
    )
    precision: str = opt(
        "fp32", "fp32; bf16 autocast (CPU, CUDA); fp16 with a gradient scaler (CUDA)", ("fp32", "bf16", "fp16")
    )
    fp8: str = opt(
        "off",
        "FP8 GEMMs with dynamic scaling in the encoder's linear layers (QKV, attention output, "
        "FFN in and out), one scale per tensor or per row (docs/fp8.md)",
        ("off", "tensorwise", "rowwise"),
    )
    fp8_impl: str = opt("torchao", "what runs train.fp8: torchao's float8 training", ("torchao",))
    device: str = opt("auto", "auto picks cuda when available", ("auto", "cpu", "cuda"))
    log_interval_steps: int = opt(10, "steps between progress lines and metrics.jsonl records")
    max_nonfinite_steps: int = opt(10, "consecutive non-finite losses before the run stops")
    flat_host_memory: bool = opt(
        False,
        "fix glibc's mmap threshold at 128 KiB: host memory stays flat over long CPU runs, "
        "but CPU training is ~1.5x slower (docs/reliability.md)",
    )
    static_shapes: bool = opt(
        False,
        "pad each micro-batch's tokens and masked positions up to a bucket, with one extra "
        "sequence no loss or count sees (data/static_shapes.py; unpadded layout only)",
    )
    static_token_bucket: int | str = opt(
        "auto",
        "the token bucket of train.static_shapes; auto: 2% of micro-batch x data.max_seq_length, "
        "a multiple of 64 (about 2% padding, 15 shapes over MLPerf's 8-GPU recipe; docs/step.md)",
    )
    static_masked_bucket: int = opt(64, "the masked-position bucket of train.static_shapes")
    cuda_graphs: bool = opt(
        False,
        "capture the encoder's forward and backward in a CUDA graph per shape bucket (CUDA only; "
        "needs train.static_shapes and a graph-safe attention backend; docs/step.md)",
    )
    batch_size_warmup_start: int | None = opt(
        None,
        "batch-size warm-up (ModernBERT's): the global batch of step 0, a multiple of "
        "global_batch_size / grad_accum_steps (one micro-batch on every rank), growing by that much "
        "at equal intervals to global_batch_size at step batch_size_warmup_steps; null: off "
        "(data/batch_ramp.py, docs/modern_encoders.md)",
    )
    batch_size_warmup_steps: int = opt(0, "optimizer steps of the batch-size warm-up (with batch_size_warmup_start)")

    def __post_init__(self):
        _check("train", self)
        self._check_batch_size_warmup()
        _auto_or_positive("train.static_token_bucket", self.static_token_bucket, "a number of tokens")
        _positive("train.static_masked_bucket", self.static_masked_bucket)
        for name in (
            "global_batch_size",
            "grad_accum_steps",
            "max_steps",
            "max_samples",
            "log_interval_steps",
            "max_nonfinite_steps",
        ):
            _positive(f"train.{name}", getattr(self, name))
        _positive("train.seed", self.seed, allow_zero=True)

    def _check_batch_size_warmup(self) -> None:
        start, steps = self.batch_size_warmup_start, self.batch_size_warmup_steps
        _positive("train.batch_size_warmup_steps", steps, allow_zero=True)
        if start is None:
            if steps:
                raise ConfigError(
                    "train.batch_size_warmup_steps: set train.batch_size_warmup_start too (the first batch)"
                )
            return
        _positive("train.batch_size_warmup_start", start)
        unit, full = self.global_batch_size // self.grad_accum_steps, self.global_batch_size
        if start >= full:
            raise ConfigError(f"train.batch_size_warmup_start: {start} must be below train.global_batch_size {full}")
        if self.global_batch_size % self.grad_accum_steps == 0 and start % unit:
            raise ConfigError(
                f"train.batch_size_warmup_start: {start} is not a multiple of train.global_batch_size / "
                f"train.grad_accum_steps = {unit} (the ramp grows one micro-batch per rank at a time)"
            )
        if steps < 1:
            raise ConfigError("train.batch_size_warmup_steps: must be >= 1 with train.batch_size_warmup_start set")


@dataclass
class EvalSection:
    interval_samples: int | str = opt(
        "auto",
        "evaluate every this many training samples; auto: MLPerf's rule, "
        "floor(0.05 x (230.23 x global batch + 3,000,000) / 25,000) x "
        "25,000",
    )
    target_accuracy: float = opt(0.720, "stop with status success at this masked-LM accuracy")
    batch_size: int = opt(125, "eval sequences per rank per batch")
    max_samples: int | None = opt(None, "evaluate on the first N eval samples only (MLPerf: all)")
    at_start: bool = opt(
        False,
        "evaluate the initial weights before training, during initialisation (untimed, "
        "not an MLPerf eval_accuracy event): MLPerf's phase-1 checkpoint scores about "
        "0.34, which checks that it loaded right. Not in the closed division, where "
        "nothing may read the dataset before run_start",
    )
    cache_on_device: bool = opt(
        False,
        "collate the eval set once and keep its batches on the device (about 75 MB for "
        "MLPerf's 10,000 samples; docs/step.md); accuracy is read once per evaluation either way",
    )

    def __post_init__(self):
        _check("eval", self)
        _auto_or_positive("eval.interval_samples", self.interval_samples, "a number of samples")
        _positive("eval.batch_size", self.batch_size)
        _positive("eval.max_samples", self.max_samples)
        if not 0.0 < self.target_accuracy <= 1.0:
            raise ConfigError(f"eval.target_accuracy: must lie in (0, 1], got {self.target_accuracy}")


@dataclass
class AdaGCSection:
    lambda_rel: float = opt(1.04, "after warm-up, clip tensor i at lambda_rel x its running threshold")
    beta: float = opt(0.99, "EMA factor of the per-tensor thresholds")
    warmup_steps: int = opt(100, "steps of global-norm clipping at lambda_abs before per-tensor clipping")
    lambda_abs: float = opt(1.0, "global-norm threshold during AdaGC's warm-up")
    eps: float = opt(1e-6, "added to norms before dividing")

    def __post_init__(self):
        _check("optim.adagc", self)
        for name in ("lambda_rel", "lambda_abs", "eps"):
            _positive(f"optim.adagc.{name}", getattr(self, name))
        _positive("optim.adagc.warmup_steps", self.warmup_steps, allow_zero=True)
        if not 0.0 <= self.beta < 1.0:
            raise ConfigError(f"optim.adagc.beta: must lie in [0, 1), got {self.beta}")


@dataclass
class OptimSection:
    name: str = opt(
        "lamb",
        "optimizer: lamb (MLPerf's), adamw (decoupled weight decay), or stable_adamw (AdamW with "
        "StableAdamW's per-tensor update clipping, ModernBERT's; docs/modern_encoders.md)",
        ("lamb", "adamw", "stable_adamw"),
    )
    lr: float = opt(4.25e-4, "peak learning rate")
    betas: tuple[float, float] = opt((0.9, 0.999), "Adam/LAMB betas")
    weight_decay: float = opt(0.01, "decoupled weight decay (not on biases and LayerNorm)")
    decouple_lr: bool = opt(
        False,
        "adamw / stable_adamw: weight decay independent of the learning rate's size, "
        "w <- w (1 - lr_t / optim.lr x weight_decay) (fully decoupled; ModernBERT's); false: torch's "
        "w <- w (1 - lr_t x weight_decay)",
    )
    eps: float = opt(1e-6, "Adam/LAMB epsilon")
    warmup_steps: int = opt(0, "linear warm-up steps")
    start_warmup_step: int = opt(0, "step at which warm-up starts (MLPerf's start_warmup_step)")
    poly_power: float = opt(1.0, "power of the polynomial decay to 0")
    total_steps: int | None = opt(None, "steps of the decay (default: train.max_steps)")
    schedule: str = opt(
        "poly",
        "poly: warm-up then polynomial decay from step 0 (MLPerf); wsd: warm-up, constant, then "
        "decay over the last decay_steps (ModernBERT's warmup-stable-decay)",
        ("poly", "wsd"),
    )
    decay_steps: int = opt(0, "wsd: steps of the final decay (0: constant to the end)")
    decay_shape: str = opt("1-sqrt", "wsd: shape of the final decay", ("1-sqrt", "linear"))
    clip: str = opt(
        "global", "gradient clipping: global norm, AdaGC (per tensor, adaptive) or none", ("global", "adagc", "none")
    )
    max_grad_norm: float = opt(1.0, "global-norm clipping threshold")
    adagc: AdaGCSection = field(default_factory=AdaGCSection, metadata={"help": "AdaGC's parameters"})
    shard: int | str = opt(
        "none",
        "split the optimizer state and update over a group of ranks (FSDP2, docs/sharding.md): "
        "none (every rank updates everything, DDP), dp (all ranks), or a group size dividing the "
        "ranks (HSDP: groups of that many ranks, replicated across groups)",
    )
    reduce_dtype: str = opt(
        "fp32", "dtype gradients are reduce-scattered in (optim.shard only)", ("fp32", "bf16", "fp16")
    )
    impl: str = opt(
        "auto",
        "LAMB's implementation: auto (apex's fused kernel where importable on CUDA, else torch), "
        "torch, or apex (FusedLAMB; with optim.shard, DistributedFusedLAMB; an error where apex "
        "cannot run)",
        ("auto", "torch", "apex"),
    )

    def __post_init__(self):
        _check("optim", self)
        if isinstance(self.shard, str) and self.shard not in ("none", "dp"):
            raise ConfigError(f"optim.shard: expected none, dp or a group size, got {self.shard!r}")
        if isinstance(self.shard, int) and self.shard < 1:
            raise ConfigError(f"optim.shard: a group size must be >= 1, got {self.shard}")
        if self.decouple_lr and self.name == "lamb":
            raise ConfigError(
                "optim.decouple_lr: applies to adamw and stable_adamw (LAMB decays inside its trust ratio)"
            )
        if self.shard != "none" and self.name != "lamb":
            raise ConfigError(f"optim.shard: sharding runs LAMB (optim.name=lamb), got optim.name={self.name!r}")
        if self.shard == "none" and self.reduce_dtype != "fp32":
            raise ConfigError(
                f"optim.reduce_dtype: {self.reduce_dtype} applies to sharded gradients; set optim.shard "
                "(unsharded DDP reduces in fp32)"
            )
        _positive("optim.lr", self.lr)
        _positive("optim.eps", self.eps)
        _positive("optim.weight_decay", self.weight_decay, allow_zero=True)
        _positive("optim.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("optim.max_grad_norm", self.max_grad_norm)
        _positive("optim.total_steps", self.total_steps)
        _positive("optim.decay_steps", self.decay_steps, allow_zero=True)
        if self.schedule == "wsd" and self.start_warmup_step:
            raise ConfigError("optim.start_warmup_step: the wsd schedule warms up from step 0; leave it 0")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas: each must lie in [0, 1), got {list(self.betas)}")


@dataclass
class LossSection:
    simreg_weight: float = opt(0.0, "weight of the SimReg contrastive regulariser (0: off, costs nothing)")
    simreg_temperature: float = opt(0.1, "SimReg softmax temperature")
    simreg_scope: str = opt("masked", "SimReg tokens: the masked positions or all tokens", ("masked", "all"))

    def __post_init__(self):
        _check("loss", self)
        _positive("loss.simreg_weight", self.simreg_weight, allow_zero=True)
        _positive("loss.simreg_temperature", self.simreg_temperature)


@dataclass
class DebugSection:
    spike_steps: list[int] = opt([], "optimizer steps (1-based) at which gradients are multiplied by spike_factor")
    spike_params: list[str] = opt([], "parameter-name substrings the spikes hit (empty: every parameter)")
    spike_factor: float = opt(100.0, "gradient multiplier at spike steps")
    nonfinite_steps: list[int] = opt(
        [], "optimizer steps at which a gradient entry is set to nonfinite_value (tests the skip)"
    )
    nonfinite_value: str = opt("nan", "what debug.nonfinite_steps writes into the gradient", ("nan", "inf", "-inf"))

    def __post_init__(self):
        _check("debug", self)


@dataclass
class LogSection:
    division: str = opt("open", "MLPerf division written to the log", ("open", "closed"))
    submitter: str = opt(
        "",
        "MLPerf submitter (submission_org): your organisation; the closed division "
        "needs it set, the open division logs unpadded-bert when it is empty",
    )
    platform: str = opt("", "MLPerf platform name (default: the device)")
    mlperf: bool = opt(True, "write OUTPUT_DIR/mlperf.log (needs mlperf_logging); false: train without it")
    plot: bool = opt(True, "write curves.png at the end")
    tensorboard: bool = opt(False, "write TensorBoard events to OUTPUT_DIR/tensorboard/ (rank 0)")

    def __post_init__(self):
        _check("log", self)


@dataclass
class CheckpointSection:
    interval_steps: int = opt(0, "save every this many steps (0: only on SIGTERM)")
    init: str | None = opt(None, "initial weights: a transformers directory or NVIDIA's MLPerf .pt")
    keep: int = opt(2, "checkpoints kept in DIR/checkpoints")
    at_end: bool = opt(False, "also save when the run ends (the final weights, for python -m bert.export)")
    on_error: str = opt(
        "continue",
        "a checkpoint that cannot be written (no space, no permission): the error "
        "is reported, the previous checkpoint kept, and the run goes on or stops "
        "(status aborted, exit status 1)",
        ("continue", "stop"),
    )

    def __post_init__(self):
        _check("checkpoint", self)
        _positive("checkpoint.interval_steps", self.interval_steps, allow_zero=True)
        _positive("checkpoint.keep", self.keep)


@dataclass
class DistSection:
    backend: str = opt("auto", "process-group backend (auto: nccl on CUDA, gloo on CPU)", ("auto", "nccl", "gloo"))
    timeout_s: float = opt(600.0, "collectives fail instead of hanging after this many seconds")

    def __post_init__(self):
        _check("dist", self)
        _positive("dist.timeout_s", self.timeout_s)


# MLPerf BERT (v5.0, its last round): what the closed division fixes.
CLOSED_EVAL_SAMPLES = 10_000
CLOSED_TARGET_ACCURACY = 0.720
CLOSED_MAX_SEQ_LENGTH = 512
CLOSED_MAX_GRAD_NORM = 1.0
CLOSED_DROPOUT = 0.1


def mlperf_eval_interval(global_batch_size: int) -> int:
    """Samples between evaluations by the rule: floor(0.05 x (230.23 x GBS + 3,000,000) / 25,000) x 25,000."""
    return math.floor(0.05 * (230.23 * global_batch_size + 3_000_000) / 25_000) * 25_000


def eval_interval(cfg: RunConfig) -> int:
    """eval.interval_samples in samples (``auto`` resolved by the rule)."""
    value = cfg.eval.interval_samples
    return mlperf_eval_interval(cfg.train.global_batch_size) if value == "auto" else value


def check_closed_division(cfg: RunConfig) -> None:
    """log.division=closed: refuse what the MLPerf rules forbid or the benchmark fixes (one field per error)."""
    m, o = cfg.model, cfg.optim
    why = "the closed division"
    if cfg.log.submitter == "":
        raise ConfigError(f"log.submitter: {why} logs your organisation as submission_org; set it")
    if o.name != "lamb":
        raise ConfigError(f"optim.name: {why} trains with LAMB, got {o.name!r}")
    if cfg.train.batch_size_warmup_start is not None:
        raise ConfigError(f"train.batch_size_warmup_start: {why} trains at one global batch size; leave it null")
    if o.clip != "global":
        raise ConfigError(f"optim.clip: {why} clips by global norm as the reference does, got {o.clip!r}")
    if o.max_grad_norm != CLOSED_MAX_GRAD_NORM:
        raise ConfigError(
            f"optim.max_grad_norm: {why} clips at the reference's {CLOSED_MAX_GRAD_NORM}, got {o.max_grad_norm}"
        )
    if cfg.eval.at_start:
        raise ConfigError(
            f"eval.at_start: {why} starts the clock before anything reads the dataset; "
            "evaluate the initial checkpoint in an open-division run"
        )
    if cfg.loss.simreg_weight > 0:
        raise ConfigError(f"loss.simreg_weight: {why} trains on the reference loss (MLM + NSP); SimReg must be 0")
    for name in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        value = getattr(m, name)
        if value is not None and value != CLOSED_DROPOUT:
            raise ConfigError(f"model.{name}: {why} keeps BERT-large's dropout {CLOSED_DROPOUT}, got {value}")
    if m.preset != "large":
        raise ConfigError(f"model.preset: {why} trains BERT-large, got {m.preset!r}")
    if m.vocab_size is not None and m.vocab_size != PRESETS["large"].vocab_size:
        raise ConfigError(
            f"model.vocab_size: {why} keeps BERT-large's {PRESETS['large'].vocab_size}, got {m.vocab_size}"
        )
    if o.schedule != "poly":
        raise ConfigError(f"optim.schedule: {why} decays polynomially as the reference does, got {o.schedule!r}")
    if m.config_file:
        shape = read_model_config_file(m.config_file)
        large = PRESETS["large"]
        # A ModernBERT-class file can have BERT-large's sizes; its parts (norms, positions, ...) tell.
        part = next((f for f in fields(shape) if f.metadata.get("part") and getattr(shape, f.name) != f.default), None)
        if part is not None:
            raise ConfigError(
                f"model.config_file: {why} trains BERT-large, but {m.config_file} sets {part.name} "
                f"{getattr(shape, part.name)!r} (BERT-large: {part.default!r})"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "max_position_embeddings",
            "type_vocab_size",
            "hidden_dropout_prob",
            "attention_probs_dropout_prob",
        ):
            if getattr(shape, name) != getattr(large, name):
                raise ConfigError(
                    f"model.config_file: {why} trains BERT-large, but {m.config_file} sets {name} "
                    f"{getattr(shape, name)} (BERT-large: {getattr(large, name)})"
                )
    if cfg.data.max_seq_length != CLOSED_MAX_SEQ_LENGTH:
        raise ConfigError(f"data.max_seq_length: {why} uses {CLOSED_MAX_SEQ_LENGTH}, got {cfg.data.max_seq_length}")
    if not cfg.checkpoint.init:
        raise ConfigError(f"checkpoint.init: {why} starts from the phase-1 checkpoint (model.ckpt-28252); set its path")
    rule = mlperf_eval_interval(cfg.train.global_batch_size)
    if cfg.eval.interval_samples not in ("auto", rule):
        raise ConfigError(
            f"eval.interval_samples: {why} evaluates every {rule:,} samples at global batch "
            f"{cfg.train.global_batch_size} (auto), got {cfg.eval.interval_samples}"
        )
    if cfg.eval.max_samples is not None:
        raise ConfigError(
            f"eval.max_samples: {why} evaluates on all {CLOSED_EVAL_SAMPLES:,} eval samples; leave it unset"
        )
    if cfg.eval.target_accuracy != CLOSED_TARGET_ACCURACY:
        raise ConfigError(
            f"eval.target_accuracy: {why} stops at masked-LM accuracy {CLOSED_TARGET_ACCURACY}, "
            f"got {cfg.eval.target_accuracy}"
        )
    for name in ("spike_steps", "nonfinite_steps"):
        if getattr(cfg.debug, name):
            raise ConfigError(f"debug.{name}: {why} trains without injected faults; leave it empty")


def read_model_config_file(path: str) -> BertConfig:
    """model.config_file's architecture; ConfigError naming the file and the field it gets wrong
    (an unknown hidden_act, for instance), so a bad file is found when the config is checked."""
    try:
        return BertConfig.from_json(path)
    except (BertConfigError, OSError) as e:
        message = str(e) if str(e).startswith(path) else f"{path}: {e}"
        raise ConfigError(f"model.config_file: {message}") from None


def check_cuda_graphs(cfg: RunConfig) -> None:
    """train.cuda_graphs: the combinations a CUDA graph can replay (raised before any work)."""
    import torch

    t = cfg.train
    if t.device == "cpu" or not torch.cuda.is_available():
        raise ConfigError("train.cuda_graphs: CUDA graphs need a CUDA device (train.device=cuda on a GPU)")
    if not t.static_shapes:
        raise ConfigError("train.cuda_graphs: a graph replays fixed shapes; set train.static_shapes=true")
    refused = registry.graph_refusal(cfg.model.attention, 0.0)  # the dropout: when the model is built
    if refused:
        raise ConfigError(f"train.cuda_graphs: {refused}")
    if cfg.model.compile:
        raise ConfigError("train.cuda_graphs: model.compile captures its own graphs; use one of the two")
    if cfg.optim.shard != "none":
        raise ConfigError(
            "train.cuda_graphs: optim.shard's FSDP2 gathers each layer's weights in hooks a graph cannot "
            "replay; set optim.shard=none"
        )
    if cfg.loss.simreg_weight > 0:
        raise ConfigError(
            "train.cuda_graphs: SimReg sizes its blocks from the batch on the host; set loss.simreg_weight=0"
        )


def check_cross_fields(cfg: RunConfig) -> None:
    """Constraints between sections (raised before any work)."""
    if cfg.model.config_file:
        read_model_config_file(cfg.model.config_file)
    layout, attention = cfg.data.layout, cfg.model.attention
    takes = registry.layouts_of(attention)
    if ATTENTION_LAYOUTS[layout] not in takes:  # whether the machine can run it is checked when it is built
        need = " or ".join(kind for kind, lay in ATTENTION_LAYOUTS.items() if lay in takes)
        raise ConfigError(
            f"model.attention: {attention} needs data.layout={need}, got {layout!r}; data.layout={layout} runs "
            f"with {', '.join(registry.backends_for(ATTENTION_LAYOUTS[layout]))}"
        )
    if cfg.loss.simreg_weight > 0 and layout == "padded":
        raise ConfigError("loss.simreg_weight: SimReg runs on the unpadded and packed layouts, not padded")
    if layout == "packed" and cfg.data.backend != "torch":
        raise ConfigError("data.backend: the packed layout collates with 'torch' only")
    if cfg.train.fp8 != "off" and cfg.model.bias_gelu == "epilogue":
        raise ConfigError(
            "model.bias_gelu: epilogue is a bf16/fp32 GEMM; with train.fp8 the FFN-in GEMM is FP8 (use triton or eager)"
        )
    t = cfg.train
    if t.static_shapes and layout != "unpadded":
        raise ConfigError(f"train.static_shapes: pads unpadded batches; data.layout is {layout!r}")
    if t.cuda_graphs:
        check_cuda_graphs(cfg)
    if cfg.log.division == "closed":
        check_closed_division(cfg)


@dataclass
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    train: TrainSection = field(default_factory=TrainSection)
    eval: EvalSection = field(default_factory=EvalSection)
    optim: OptimSection = field(default_factory=OptimSection)
    loss: LossSection = field(default_factory=LossSection)
    log: LogSection = field(default_factory=LogSection)
    checkpoint: CheckpointSection = field(default_factory=CheckpointSection)
    dist: DistSection = field(default_factory=DistSection)
    debug: DebugSection = field(default_factory=DebugSection)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in fields(RunConfig)}


def build_config(values: dict) -> RunConfig:
    sections = _sections()
    if not isinstance(values, dict):
        raise ConfigError("config: expected a mapping of sections")
    unknown = sorted(set(values) - set(sections))
    if unknown:
        raise ConfigError(f"config: unknown section(s) {unknown}; valid: {sorted(sections)}")
    built = {}
    for name, cls in sections.items():
        given = values.get(name) or {}
        if not isinstance(given, dict):
            raise ConfigError(f"{name}: expected a mapping of fields, got {given!r}")
        valid = [f.name for f in fields(cls)]
        bad = sorted(set(given) - set(valid))
        if bad:
            raise ConfigError(f"{name}.{bad[0]}: unknown field; valid fields of {name}: {valid}")
        built[name] = cls(**given)
    cfg = RunConfig(**built)
    check_cross_fields(cfg)
    return cfg


def apply_override(values: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"{override!r}: overrides take the form section.field=value")
    key, raw = override.split("=", 1)
    parts = key.split(".")
    if len(parts) < 2:
        raise ConfigError(f"{key}: overrides name section.field")
    cls = RunConfig
    target = values
    for depth, name in enumerate(parts):
        where = ".".join(parts[:depth]) or "config"
        hints = typing.get_type_hints(cls)
        valid = [f.name for f in fields(cls)]
        if name not in valid:
            what = "section" if depth == 0 else "field"
            raise ConfigError(f"{'.'.join(parts[: depth + 1])}: unknown {what}; valid {what}s of {where}: {valid}")
        if depth == len(parts) - 1:
            break
        hint = hints[name]
        inner = [a for a in typing.get_args(hint) if dataclasses.is_dataclass(a)]
        cls = hint if dataclasses.is_dataclass(hint) else (inner[0] if inner else None)
        if cls is None:
            raise ConfigError(f"{key}: {'.'.join(parts[: depth + 1])} has no fields")
        if not isinstance(target.get(name), dict):
            target[name] = {}
        target = target[name]
    hint = typing.get_type_hints(cls)[parts[-1]]
    if hint is str:
        value = raw
    elif typing.get_origin(hint) in (typing.Union, types.UnionType) and set(typing.get_args(hint)) == {str, type(None)}:
        value = None if raw in ("null", "~") else raw
    else:
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
    target[parts[-1]] = value


def load_config(path: str | None, overrides: list[str] = ()) -> RunConfig:
    values: dict = {}
    if path:
        try:
            with open(path, encoding="utf-8") as f:
                values = yaml.safe_load(f) or {}
        except OSError as e:
            raise ConfigError(f"{path}: cannot read ({e.strerror})") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
        if not isinstance(values, dict):
            raise ConfigError(f"{path}: expected a mapping of sections")
    for o in overrides:
        apply_override(values, o)
    try:
        return build_config(values)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from None
    except TypeError as e:
        raise ConfigError(f"{path or 'config'}: {e}") from None


def describe() -> str:
    """Every field with its default and meaning, for --help."""
    lines = []
    for section, cls in _sections().items():
        lines.append(f"{section}:")
        lines.extend(_describe_fields(section, cls))
    return "\n".join(lines)


def _describe_fields(prefix: str, cls) -> list[str]:
    lines = []
    hints = typing.get_type_hints(cls)
    for f in fields(cls):
        if dataclasses.is_dataclass(hints[f.name]) or any(
            dataclasses.is_dataclass(a) for a in typing.get_args(hints[f.name])
        ):
            sub = (
                hints[f.name]
                if dataclasses.is_dataclass(hints[f.name])
                else [a for a in typing.get_args(hints[f.name]) if dataclasses.is_dataclass(a)][0]
            )
            lines.extend(_describe_fields(f"{prefix}.{f.name}", sub))
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        choices = f.metadata.get("choices")
        extra = f" (one of {', '.join(map(str, choices))})" if choices else ""
        lines.append(f"  {prefix}.{f.name} = {default!r}\n      {f.metadata.get('help', '')}{extra}")
    return lines
