"""The run configuration: one typed dataclass per component, loaded from YAML.

``load_config(path, overrides)`` reads ``launch/configs/*.yaml`` and applies command-line
``section.field=value`` overrides (parsed by ``common.config``). Each field's default and meaning
live here, once, checked where defined; ``describe()`` prints them for ``--help``. Anything invalid
is a one-line ``ConfigError`` naming ``section.field`` (docs/training.md, "Configuration").
"""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import typing
from dataclasses import dataclass, field, fields, replace

from bert.model.config import PRESETS, BertConfig, resolve_bias_gelu
from bert.model.hf import read_config
from common import config as cli
from common.config import option as opt
from common.errors import ConfigError
from data.rebalance.plan import check_cost
from kernels import registry
from kernels.interface import PackedLayout, PaddedLayout, VarlenLayout

# data.layout -> the attention layout the model builds from such a batch.
ATTENTION_LAYOUTS = {"unpadded": VarlenLayout, "padded": PaddedLayout, "packed": PackedLayout}


def _in_range(key: str, value, least=None, most=None, above=None) -> None:
    if value is None:
        return
    too_low = (least is not None and value < least) or (above is not None and value <= above)
    if too_low or (most is not None and value > most):
        low = f"> {above}" if above is not None else f">= {least}" if least is not None else ""
        high = f"<= {most:,}" if most is not None else ""
        raise ConfigError(f"{key}: must be {' and '.join(x for x in (low, high) if x)}, got {cli.short(value, 40)}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value is not None and (value < 0 or (value == 0 and not allow_zero)):
        raise ConfigError(f"{key}: must be {'non-negative' if allow_zero else 'positive'}, got {value!r}")


def _auto_or_positive(key: str, value, what: str) -> None:
    if isinstance(value, str):
        if value != "auto":
            raise ConfigError(f"{key}: expected {what} or auto, got {cli.short(value)}")
    else:
        _positive(key, value)


@dataclass
class ModelSection:
    preset: str = opt(
        "large", "architecture (bert.model.config.PRESETS): BERT's, or a ModernBERT-class encoder", tuple(PRESETS)
    )
    config_file: str | None = opt(None, "bert_config.json or transformers config.json; overrides preset")
    overrides: dict = opt(
        {},
        "BertConfig fields over the preset's or config_file's (bert/model/config.py checks them), e.g. "
        "model.overrides.vocab_size=96, model.overrides.hidden_dropout_prob=0 or "
        "model.overrides.rope_theta_global=160000 (a context-extension phase)",
    )
    attention: str = opt(
        "reference",
        "attention backend (kernels.registry): "
        + "; ".join(
            f"{', '.join(registry.backends_for(lay))} ({kind} layout)" for kind, lay in ATTENTION_LAYOUTS.items()
        ),
        registry.BACKENDS.keys(),  # a live view: a backend registered later is a choice too
    )
    attention_options: dict = opt(
        {},
        "the backend's own options (kernels.registry; the backend checks the values), e.g. triton_grouped's "
        "model.attention_options.buckets=[128,256,512,1024] (sequence-length buckets, one launch per "
        "group; default 128/256/384/512) and num_streams (CUDA streams, default 4)",
    )
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
    compile: bool = opt(False, "wrap the model in torch.compile")

    def __post_init__(self):
        cli.check_choices("model", self, ConfigError)  # types and choices of every field
        names = [f.name for f in fields(BertConfig)]
        if bad := [k for k in self.overrides if k not in names]:  # a list: a YAML null key is wrong too
            raise ConfigError(f"model.overrides.{cli.cut(str(bad[0]), 60)}: not a BertConfig field; valid: {names}")
        takes = registry.BACKENDS[self.attention].options
        if bad := [k for k in self.attention_options if k not in takes]:
            raise ConfigError(
                f"model.attention_options.{cli.cut(str(bad[0]), 60)}: {self.attention} takes no such option; "
                f"its options: {list(takes)}"
            )
        # The architecture, resolved once: not a field (it follows from preset, config_file, overrides).
        self.shape = model_shape(self)
        resolve_bias_gelu(self.shape, self.fused_ops, self.bias_gelu)


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
    rebalance_cost: list[float] = opt(
        [1.0, 1.0 / 6144],
        "[a, b] of the per-sample cost a*L + b*L^2, or [a, b, b_local, window] adding the sliding-window "
        "layers' b_local*L*min(L, window) (python -m bench.fit_cost fits all four; docs/rebalancing.md)",
    )
    rebalance_measured: tuple[int, float, float, float] = opt(
        (32, 4.0, 0.1, 2.0),
        "measured: (window: steps kept per rank, bound: the factor a fitted coefficient stays within "
        "of rebalance_cost's, rate: the largest relative change of a speed or coefficient per step, "
        "max_share: the most samples a rank may hold, over its share of the batch; above 1 a slow rank "
        "gives away more samples than it takes, which it needs where most have the maximum length)",
    )
    rebalance_group_size: int | None = opt(
        None, "hierarchical rebalancing in groups of this many ranks (e.g. GPUs per node, for thousands of ranks)"
    )
    on_corrupt: str = opt(
        "fail",
        "a training sample that fails validation or cannot be read: fail stops the run naming file and sample; skip "
        "replaces it by the next good sample of the epoch's stream and counts it (metrics corrupt_samples, summary)",
        ("fail", "skip"),
    )

    def __post_init__(self):
        cli.check_choices("data", self, ConfigError)
        _in_range("data.max_seq_length", self.max_seq_length, least=1, most=1 << 20)
        _in_range("data.max_predictions_per_seq", self.max_predictions_per_seq, least=1, most=1 << 20)
        _positive("data.rebalance_group_size", self.rebalance_group_size)
        try:
            check_cost(self.rebalance_cost)
        except ValueError as e:
            raise ConfigError(f"data.rebalance_cost: {str(e).removeprefix('cost: ')}") from e
        window, bound, rate, max_share = got = self.rebalance_measured
        if window < 2 or not 1 <= bound < math.inf or not 0 < rate <= 1 or not 1 <= max_share <= 16:
            raise ConfigError(
                "data.rebalance_measured: expected window >= 2, bound >= 1, 0 < rate <= 1, 1 <= max_share <= 16, "
                f"got {got}"
            )


@dataclass
class TrainSection:
    global_batch_size: int = opt(448, "sequences per optimizer step, over all ranks")
    grad_accum_steps: int = opt(1, "micro-batches per optimizer step on each rank")
    max_steps: int = opt(6700, "stop (status aborted) after this many optimizer steps")
    max_samples: int = opt(4_500_000, "stop (status aborted) after this many training samples")
    seed: int | None = opt(
        None,
        "seeds data order, initialisation and dropout; unset (null): rank 0 draws one from the OS and broadcasts it, "
        "so each run has its own (MLPerf closed division); the seed used is logged and kept in checkpoints",
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
        "the token bucket of train.static_shapes (masked positions: multiples of 64); auto: 2% of micro-batch x "
        "data.max_seq_length, a multiple of 64 (about 2% padding, 15 shapes over MLPerf's 8-GPU recipe; docs/step.md)",
    )
    cuda_graphs: bool = opt(
        False,
        "capture the encoder's forward and backward in a CUDA graph per shape bucket (CUDA only; "
        "needs train.static_shapes and a graph-safe attention backend; docs/step.md)",
    )
    batch_size_warmup: tuple[int, int] | None = opt(
        None,
        "batch-size warm-up (ModernBERT's), [start, steps]: the global batch of step 0, a multiple of "
        "global_batch_size / grad_accum_steps (one micro-batch on every rank), growing by that much at equal intervals "
        "to global_batch_size at step `steps`; null: off (data/batch_ramp.py, docs/modern_encoders.md)",
    )

    def __post_init__(self):
        cli.check_choices("train", self, ConfigError)
        positive = "global_batch_size grad_accum_steps max_steps max_samples log_interval_steps max_nonfinite_steps"
        for name in positive.split():
            _positive(f"train.{name}", getattr(self, name))
        _in_range("train.seed", self.seed, least=0)
        _auto_or_positive("train.static_token_bucket", self.static_token_bucket, "a number of tokens")
        if self.batch_size_warmup is None:
            return
        (start, steps), key, full = self.batch_size_warmup, "train.batch_size_warmup", self.global_batch_size
        unit = full // self.grad_accum_steps
        if not 0 < start < full:
            raise ConfigError(f"{key}: start {start} must lie in [1, train.global_batch_size {full})")
        if self.global_batch_size % self.grad_accum_steps == 0 and start % unit:
            raise ConfigError(
                f"{key}: start {start} is not a multiple of train.global_batch_size / "
                f"train.grad_accum_steps = {unit} (the ramp grows one micro-batch per rank at a time)"
            )
        if steps < 1:
            raise ConfigError(f"{key}: steps must be >= 1, got {steps}")


@dataclass
class EvalSection:
    interval_samples: int | str = opt(
        "auto",
        "evaluate every this many training samples; auto: MLPerf's rule, floor(0.05 x (230.23 x global batch + "
        "3,000,000) / 25,000) x 25,000",
    )
    target_accuracy: float = opt(0.720, "stop with status success at this masked-LM accuracy")
    batch_size: int = opt(125, "eval sequences per rank per batch")
    max_samples: int | None = opt(None, "evaluate on the first N eval samples only (MLPerf: all)")
    at_start: bool = opt(
        False,
        "evaluate the initial weights before training, during initialisation (untimed, not an MLPerf eval_accuracy "
        "event): MLPerf's phase-1 checkpoint scores about 0.34, which checks that it loaded right. Not in the closed "
        "division, where nothing may read the dataset before run_start",
    )
    cache_on_device: bool = opt(
        False,
        "collate the eval set once and keep its batches on the device (about 75 MB for "
        "MLPerf's 10,000 samples; docs/step.md); accuracy is read once per evaluation either way",
    )

    def __post_init__(self):
        cli.check_choices("eval", self, ConfigError)
        _auto_or_positive("eval.interval_samples", self.interval_samples, "a number of samples")
        _positive("eval.batch_size", self.batch_size)
        _positive("eval.max_samples", self.max_samples)
        if not 0.0 < self.target_accuracy <= 1.0:
            raise ConfigError(f"eval.target_accuracy: must lie in (0, 1], got {self.target_accuracy}")


@dataclass
class AdaGCSection:
    lambda_rel: float = opt(1.04, "after warm-up, clip tensor i at lambda_rel x its running threshold")
    beta: float = opt(0.99, "EMA factor of the per-tensor thresholds")
    warmup_steps: int = opt(100, "steps of global-norm clipping at optim.max_grad_norm before per-tensor clipping")

    def __post_init__(self):
        cli.check_choices("optim.adagc", self, ConfigError)
        _positive("optim.adagc.lambda_rel", self.lambda_rel)
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
        "adamw / stable_adamw: weight decay independent of the learning rate's size, w <- w (1 - lr_t / optim.lr x "
        "weight_decay) (fully decoupled; ModernBERT's); false: torch's w <- w (1 - lr_t x weight_decay)",
    )
    eps: float = opt(1e-6, "Adam/LAMB epsilon")
    warmup_steps: int = opt(0, "linear warm-up steps")
    start_warmup_step: int = opt(0, "step at which warm-up starts (MLPerf's start_warmup_step)")
    poly_power: float = opt(1.0, "power of the polynomial decay to 0")
    schedule: str = opt(
        "poly",
        "poly: warm-up then polynomial decay to 0 at train.max_steps (MLPerf); wsd: warm-up, constant, then a 1-sqrt "
        "decay over the last decay_steps (ModernBERT's warmup-stable-decay); wsd_linear: the same with a linear decay",
        ("poly", "wsd", "wsd_linear"),
    )
    decay_steps: int = opt(0, "wsd: steps of the final decay (0: constant to the end)")
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

    @property
    def decay_shape(self) -> str:
        """The final decay of optim.schedule wsd (1-sqrt) or wsd_linear (linear)."""
        return "linear" if self.schedule == "wsd_linear" else "1-sqrt"

    def __post_init__(self):
        cli.check_choices("optim", self, ConfigError)
        if isinstance(self.shard, str) and self.shard not in ("none", "dp"):
            raise ConfigError(f"optim.shard: expected none, dp or a group size, got {cli.short(self.shard)}")
        _in_range("optim.shard", None if isinstance(self.shard, str) else self.shard, least=1)
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
        for name in "lr eps weight_decay warmup_steps max_grad_norm decay_steps poly_power".split():
            _positive(f"optim.{name}", getattr(self, name), allow_zero=name not in ("lr", "eps", "max_grad_norm"))
        if self.schedule != "poly" and self.start_warmup_step:
            raise ConfigError("optim.start_warmup_step: the wsd schedule warms up from step 0; leave it 0")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ConfigError(f"optim.betas: each must lie in [0, 1), got {list(self.betas)}")


@dataclass
class LossSection:
    simreg_weight: float = opt(0.0, "weight of the SimReg contrastive regulariser (0: off, costs nothing)")
    simreg_temperature: float = opt(0.1, "SimReg softmax temperature")
    simreg_scope: str = opt("masked", "SimReg tokens: the masked positions or all tokens", ("masked", "all"))

    def __post_init__(self):
        cli.check_choices("loss", self, ConfigError)
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
        cli.check_choices("debug", self, ConfigError)


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
        cli.check_choices("log", self, ConfigError)


@dataclass
class CheckpointSection:
    interval_steps: int = opt(0, "save every this many steps (0: only on SIGTERM)")
    init: str | None = opt(None, "initial weights: a transformers directory or NVIDIA's MLPerf .pt")
    keep: int = opt(2, "checkpoints kept in DIR/checkpoints")
    at_end: bool = opt(False, "also save when the run ends (the final weights, for python -m bert.checkpoint.export)")
    on_error: str = opt(
        "continue",
        "a checkpoint that cannot be written (no space, no permission): the error is reported, the previous checkpoint "
        "kept, and the run goes on or stops (status aborted, exit status 1)",
        ("continue", "stop"),
    )

    def __post_init__(self):
        cli.check_choices("checkpoint", self, ConfigError)
        _positive("checkpoint.interval_steps", self.interval_steps, allow_zero=True)
        _positive("checkpoint.keep", self.keep)


@dataclass
class DistSection:
    timeout_s: float = opt(
        600.0, "collectives fail instead of hanging after this many seconds (at most a week; nccl on CUDA, else gloo)"
    )
    context_parallel: tuple[int, int] = opt(
        (1, 8192),
        "[N, threshold]: sequences longer than threshold tokens are split across a context-parallel group of "
        "N consecutive ranks (inside data parallelism), each rank holding 1/N of the document; shorter ones "
        "stay whole (N of 1: off; docs/context_parallel.md)",
    )
    fault_tolerance: str = opt(
        "off",
        "torchft: each process is a replica that joins a quorum every step through a Lighthouse; a lost replica "
        "costs the step it failed, redone by the others on the same samples; torchft's own variables set the rest "
        "(TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID, TORCHFT_TIMEOUT_SEC; docs/reliability.md)",
        ("off", "torchft"),
    )

    def __post_init__(self):
        cli.check_choices("dist", self, ConfigError)
        _in_range("dist.timeout_s", self.timeout_s, above=0, most=7 * 86400)
        size, threshold = self.context_parallel
        if not (1 <= size <= 1 << 16 and 1 <= threshold <= 1 << 30):
            raise ConfigError(f"dist.context_parallel: expected [N >= 1, threshold >= 1], got {[size, threshold]}")

    @property
    def context_size(self) -> int:
        return self.context_parallel[0]


def check_context_parallel(cfg: RunConfig) -> None:
    """dist.context_parallel's N > 1: the combinations that can split a document (raised before any work)."""
    reason = registry.refusal(cfg.model.attention, VarlenLayout, ["cu_seqlens_k"])
    t = cfg.train
    rules = (  # (refused, why): the first that applies is raised
        (
            cfg.data.layout != "unpadded",
            f"splits unpadded batches; data.layout={cfg.data.layout} "
            + ("rows hold whole sequences kept apart by FlashMask bounds" if cfg.data.layout == "packed" else "pads"),
        ),
        (reason, f"attends pieces to whole documents (keys of their own); {reason}"),
        (cfg.data.backend != "torch", "splits batches as the torch collator makes them; set data.backend=torch"),
        (t.static_shapes or t.cuda_graphs, "a piece's shapes change each step; set train.static_shapes=false"),
        (cfg.model.compile, "not traced by torch.compile; set model.compile=false"),
        (cfg.loss.simreg_weight > 0, "SimReg pairs tokens within a whole sequence; set loss.simreg_weight=0"),
        (str(cfg.optim.shard) not in ("none", "dp"), "not run with sharded groups yet; set optim.shard=dp or none"),
        (
            cfg.data.rebalance not in ("none", "balanced") or cfg.data.rebalance_group_size is not None,
            "the exchange places split documents with data.rebalance=balanced (no rebalance_group_size) "
            "or none; measured's fit times whole samples",
        ),
        (t.batch_size_warmup is not None, "not run with train.batch_size_warmup yet"),
    )
    if why := next((why for bad, why in rules if bad), None):
        raise ConfigError(f"dist.context_parallel={list(cfg.dist.context_parallel)}: {why}")


# MLPerf BERT (v5.0, its last round): what the closed division fixes.
CLOSED_EVAL_SAMPLES = 10_000
CLOSED_TARGET_ACCURACY = 0.720
CLOSED_MAX_SEQ_LENGTH = 512
CLOSED_MAX_GRAD_NORM = 1.0


def mlperf_eval_interval(global_batch_size: int) -> int:
    """Samples between evaluations by the rule: floor(0.05 x (230.23 x GBS + 3,000,000) / 25,000) x 25,000."""
    return math.floor(0.05 * (230.23 * global_batch_size + 3_000_000) / 25_000) * 25_000


def eval_interval(cfg: RunConfig) -> int:
    """eval.interval_samples in samples (``auto`` resolved by the rule)."""
    value = cfg.eval.interval_samples
    return mlperf_eval_interval(cfg.train.global_batch_size) if value == "auto" else value


def check_closed_division(cfg: RunConfig) -> None:
    """log.division=closed: refuse what the MLPerf rules forbid or the benchmark fixes (one field per error)."""
    m, o, t, e, debug = cfg.model, cfg.optim, cfg.train, cfg.eval, cfg.debug
    rule, why = mlperf_eval_interval(t.global_batch_size), "the closed division"
    rules = (  # (key, allowed, what the division does)
        ("log.submitter", cfg.log.submitter != "", "logs your organisation as submission_org; set it"),
        ("optim.name", o.name == "lamb", f"trains with LAMB, got {o.name!r}"),
        ("train.batch_size_warmup", t.batch_size_warmup is None, "trains at one global batch size; leave it null"),
        ("optim.clip", o.clip == "global", f"clips by global norm as the reference does, got {o.clip!r}"),
        ("optim.max_grad_norm", o.max_grad_norm == CLOSED_MAX_GRAD_NORM, f"clips at {CLOSED_MAX_GRAD_NORM}"),
        ("eval.at_start", not e.at_start, "starts the clock before anything reads the dataset; evaluate it open"),
        ("loss.simreg_weight", cfg.loss.simreg_weight == 0, "trains on the reference loss (MLM + NSP); set it 0"),
        ("model.preset", m.preset == "large", f"trains BERT-large, got {m.preset!r}"),
        ("optim.schedule", o.schedule == "poly", f"decays polynomially as the reference does, got {o.schedule!r}"),
        ("data.max_seq_length", cfg.data.max_seq_length == CLOSED_MAX_SEQ_LENGTH, f"uses {CLOSED_MAX_SEQ_LENGTH}"),
        ("checkpoint.init", bool(cfg.checkpoint.init), "starts from the phase-1 checkpoint (model.ckpt-28252)"),
        ("eval.interval_samples", e.interval_samples in ("auto", rule), f"evaluates every {rule:,} samples (auto)"),
        ("eval.max_samples", not e.max_samples, f"evaluates on all {CLOSED_EVAL_SAMPLES:,} samples; leave it unset"),
        ("eval.target_accuracy", e.target_accuracy == CLOSED_TARGET_ACCURACY, f"stops at {CLOSED_TARGET_ACCURACY}"),
        ("debug.spike_steps", not debug.spike_steps, "trains without injected faults; leave it empty"),
        ("debug.nonfinite_steps", not debug.nonfinite_steps, "trains without injected faults; leave it empty"),
        (
            "dist.fault_tolerance",
            cfg.dist.fault_tolerance == "off",
            "times one run on the system it declares (training rules: a result is for a defined set of hardware); "
            "a run that drops replicas trains part of its time on a smaller one; set it off",
        ),
    )
    if broken := next((r for r in rules if not r[1]), None):
        raise ConfigError(f"{broken[0]}: {why} {broken[2]}")
    shape, large = m.shape, PRESETS["large"]
    if differs := next((f.name for f in fields(large) if getattr(shape, f.name) != getattr(large, f.name)), None):
        want, got = getattr(large, differs), cli.short(getattr(shape, differs))
        if differs in m.overrides:
            raise ConfigError(f"model.overrides.{differs}: {why} trains BERT-large ({differs} {want!r}), got {got}")
        raise ConfigError(
            f"model.config_file: {why} trains BERT-large, but {m.config_file} sets {differs} {got} "
            f"(BERT-large: {want!r})"
        )


def model_shape(model: ModelSection) -> BertConfig:
    """model.preset or model.config_file, with model.overrides (checked by BertConfig); a bad
    config_file is a ConfigError naming the file and the field it gets wrong (an unknown hidden_act)."""
    path = model.config_file
    try:
        base = read_config(path) if path else PRESETS[model.preset]
    except (ConfigError, OSError) as e:
        message = str(e) if str(e).startswith(path) else f"{path}: {e}"
        raise ConfigError(f"model.config_file: {message}") from e
    try:
        return replace(base, **model.overrides)
    except ConfigError as e:
        name, _, why = str(e).partition(": ")
        raise ConfigError(f"model.overrides.{name}: {why}" if name in model.overrides else f"model: {e}") from e


def check_cuda_graphs(cfg: RunConfig) -> None:
    """train.cuda_graphs: the combinations a CUDA graph can replay (raised before any work)."""
    import torch

    t, cuda = cfg.train, cfg.train.device != "cpu" and torch.cuda.is_available()
    refused = registry.graph_refusal(cfg.model.attention, cfg.model.shape.attention_probs_dropout_prob)
    rules = (  # (refused, why): the first that applies is raised
        (not cuda, "CUDA graphs need a CUDA device (train.device=cuda on a GPU)"),
        (not t.static_shapes, "a graph replays fixed shapes; set train.static_shapes=true"),
        (refused, refused),
        (cfg.model.compile, "model.compile captures its own graphs; use one of the two"),
        (
            cfg.optim.shard != "none",
            "optim.shard's FSDP2 gathers each layer's weights in hooks a graph cannot replay; set optim.shard=none",
        ),
        (cfg.loss.simreg_weight > 0, "SimReg sizes its blocks from the batch on the host; set loss.simreg_weight=0"),
    )
    if why := next((why for bad, why in rules if bad), None):
        raise ConfigError(f"train.cuda_graphs: {why}")


def check_fault_tolerance(cfg: RunConfig) -> None:
    """dist.fault_tolerance=torchft: torchft installed, and what a replica cannot yet do refused (one line each).
    Why each: docs/reliability.md, 'Per-step fault tolerance'."""
    if importlib.util.find_spec("torchft") is None:
        raise ConfigError(
            "dist.fault_tolerance: torchft is not installed (pip install -e '.[ft]', or "
            "pip install torchft==0.2.0); dist.fault_tolerance=off trains without it"
        )
    t, d = cfg.train, cfg.data
    rules = (  # (key, refused, why)
        ("train.seed", t.seed is None, "every replica builds the same initial weights from it; set it"),
        (
            "optim.shard",
            cfg.optim.shard != "none",
            "HSDP (sharded inside a replica group, fault tolerant across) is the design, not built yet; "
            "a replica group is one rank: set optim.shard=none",
        ),
        ("data.rebalance", d.rebalance == "measured", "measured plans need every replica's step times; use balanced"),
        ("train.batch_size_warmup", t.batch_size_warmup is not None, "replicas split one fixed global batch"),
        ("train.static_shapes", t.static_shapes, "a replica's share changes with the quorum; leave it false"),
        ("data.backend", d.backend != "torch", "replicas collate their share with 'torch'"),
    )
    if broken := next((r for r in rules if r[1]), None):
        raise ConfigError(f"{broken[0]}: with dist.fault_tolerance=torchft, {broken[2]}")


def check_cross_fields(cfg: RunConfig) -> None:
    """Every constraint between sections (raised before any work; a field alone is checked by its section)."""
    layout, attention, shape = cfg.data.layout, cfg.model.attention, cfg.model.shape
    takes = registry.layouts_of(attention)
    if ATTENTION_LAYOUTS[layout] not in takes:  # whether the machine can run it is checked when it is built
        need = " or ".join(kind for kind, lay in ATTENTION_LAYOUTS.items() if lay in takes)
        raise ConfigError(
            f"model.attention: {attention} needs data.layout={need}, got {layout!r}; data.layout={layout} runs "
            f"with {', '.join(registry.backends_for(ATTENTION_LAYOUTS[layout]))}"
        )
    # Local layers hand the backend a windowed layout; packed rows carry the window in their FlashMask bounds.
    if "local" in shape.layer_types and layout != "packed":
        if reason := registry.refusal(attention, ATTENTION_LAYOUTS[layout], ["window"]):
            raise ConfigError(f"model.attention: the model has local (sliding-window) layers; {reason}")
    if cfg.data.max_seq_length > shape.max_position_embeddings:
        raise ConfigError(
            f"data.max_seq_length: {cfg.data.max_seq_length} exceeds the model's "
            f"max_position_embeddings ({shape.max_position_embeddings})"
        )
    o, steps = cfg.optim, cfg.train.max_steps
    if o.schedule != "poly" and o.warmup_steps + o.decay_steps > steps:
        raise ConfigError(
            f"optim.decay_steps: warm-up ({o.warmup_steps}) and decay ({o.decay_steps}) exceed the {steps} steps"
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
    if t.static_token_bucket != "auto":  # more than a micro-batch on one rank holds pads them all alike
        most = cfg.data.max_seq_length * t.global_batch_size
        _in_range("train.static_token_bucket", t.static_token_bucket, most=most)
    if t.cuda_graphs:
        check_cuda_graphs(cfg)
    if cfg.dist.fault_tolerance != "off":
        check_fault_tolerance(cfg)
    if cfg.dist.context_size > 1:
        check_context_parallel(cfg)
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


_SECTIONS = {f.name: f.default_factory for f in fields(RunConfig)}  # section name -> its dataclass


def build_config(values: dict) -> RunConfig:
    if not isinstance(values, dict):
        raise ConfigError("config: expected a mapping of sections")
    if unknown := sorted(set(values) - set(_SECTIONS), key=str):
        raise ConfigError(f"config: unknown section {cli.short(unknown[0], 60)}; valid: {sorted(_SECTIONS)}")
    built = {name: cli.coerce(name, values.get(name) or {}, cls, ConfigError) for name, cls in _SECTIONS.items()}
    cfg = RunConfig(**built)
    check_cross_fields(cfg)
    return cfg


def _field_hint(cls, name: str, parts: list[str]):
    """The annotation of field ``name`` of ``cls``; ConfigError if it has none."""
    valid = [f.name for f in fields(cls)]
    if name not in valid:
        what, where = ("section", "config") if cls is RunConfig else ("field", ".".join(parts[:-1]))
        raise ConfigError(f"{cli.cut('.'.join(parts), 100)}: unknown {what}; valid {what}s of {where}: {valid}")
    return typing.get_type_hints(cls)[name]


def apply_override(values: dict, override: str) -> None:
    """``section.field=value`` (or ``section.mapping.key=value``) into the YAML's ``values``."""
    key, eq, raw = override.partition("=")
    parts = key.split(".")
    if not eq or len(parts) < 2:
        raise ConfigError(f"{cli.short(override, 100)}: overrides take the form section.field=value")
    cls, target = RunConfig, values
    for depth, name in enumerate(parts[:-1]):
        hint = cli.optional(_field_hint(cls, name, parts[: depth + 1]))[0]
        if not isinstance(target.get(name), dict):
            target[name] = {}
        target = target[name]
        if hint is dict:  # a mapping field: the rest of the key is one of its keys
            if depth != len(parts) - 2:
                raise ConfigError(f"{cli.cut(key, 100)}: {'.'.join(parts[: depth + 1])} takes one key after it")
            target[parts[-1]] = cli.parse_text(raw, typing.Any, key, ConfigError)
            return
        if not dataclasses.is_dataclass(hint):
            raise ConfigError(f"{cli.cut(key, 100)}: {'.'.join(parts[: depth + 1])} has no fields")
        cls = hint
    target[parts[-1]] = cli.parse_text(raw, _field_hint(cls, parts[-1], parts), key, ConfigError)


def load_config(path: str | None, overrides: list[str] = ()) -> RunConfig:
    values = (cli.load_yaml(path, ConfigError) if path else None) or {}
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping of sections")
    for o in overrides:
        apply_override(values, o)
    try:
        return build_config(values)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}" if path else str(e)) from e


def describe() -> str:
    """Every field with its default and meaning, for --help."""
    return "\n".join(line for name, cls in _SECTIONS.items() for line in (f"{name}:", *cli.describe_fields(cls, name)))


def build_model_config(cfg: RunConfig) -> BertConfig:
    """The architecture, ``cfg.model.shape``, with data.vocab_file's vocabulary size unless overrides set vocab_size."""
    if "vocab_size" in cfg.model.overrides or not cfg.data.vocab_file:
        return cfg.model.shape
    try:
        with open(cfg.data.vocab_file, encoding="utf-8") as f:
            size = sum(1 for line in f if line.strip())
        return replace(cfg.model.shape, vocab_size=size)
    except OSError as e:
        raise ConfigError(f"data.vocab_file: cannot read {cfg.data.vocab_file!r} ({e.strerror})") from e
    except ConfigError as e:  # the size, checked by BertConfig
        raise ConfigError(f"data.vocab_file: {e}") from e
