"""The training loop: named steps from a global batch to an MLPerf result.

``Trainer(cfg, output_dir, dist_info).train()`` builds the parts (model, optimizer,
schedule, clipping, loaders, loggers), resumes from ``output_dir/checkpoints`` when a
checkpoint is there, and runs:

    for each global step:
        train_step       this rank's samples -> micro-batches -> forward/backward
                         (losses normalised by global counts, all-reduced once per step)
        optimizer_step   clip -> non-finite check (skip and count) -> LAMB -> LR schedule
        evaluate         every eval.interval_samples: masked-LM accuracy over the eval set
        checkpoint       every checkpoint.interval_steps, and when SIGTERM asked to stop
                         (bert.train_checkpoint: atomic, checksummed, the newest good one resumed)

Every collective runs inside ``Collectives.guard``: a peer that dies or hangs turns into a
``CollectiveError`` naming the collective, the step and the ranks that did not answer,
within ``dist.timeout_s``, never a hang.

Dropout randomness is re-seeded every step from (seed, step, rank), so a resumed run draws
exactly the masks an uninterrupted one would without saving RNG states.

Shape legend as in ``bert.model``: T tokens, B sequences, M masked positions.
"""

from __future__ import annotations

import contextlib
import math
import os
import secrets
import signal
import time
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist

from bert import fp8, train_checkpoint
from bert.checkpoint import CheckpointError, load_pretrained
from bert.clipping import AdaGC, clip_global_
from bert.collectives import Collectives
from bert.config import BertConfig
from bert.losses import pretraining_loss, simreg_anchor_count, simreg_loss
from bert.metrics import MetricsWriter, Progress, atomic_write_text, plot_curves, spike_score, summary_table
from bert.mlperf_log import MLPerfLogger
from bert.model import BertForPreTraining
from bert.optim import build_optimizer
from bert.schedule import PolyWarmupScheduler
from bert.train_config import CLOSED_EVAL_SAMPLES, ConfigError, RunConfig, eval_interval
from data.batch import PackedBatch
from data.collate import make_collator
from data.packing import unpack
from data.samples import SampleBlock
from data.synthetic import random_block

# Set to 1 by launch/run_and_time.sh when it dropped the page cache before this run (the
# log's cache_clear says what really happened).
CACHE_CLEARED_ENV = "MLPERF_CACHE_CLEARED"


class TrainingError(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps); the message says why."""


@dataclass
class StepResult:
    loss_parts: torch.Tensor  # [4] local: loss, mlm loss, nsp loss, simreg (each / global count)
    samples: int  # global
    tokens: int  # global
    corrupt: int = 0  # global: corrupt samples replaced in this step's batch (data.on_corrupt=skip)


def build_model_config(cfg: RunConfig) -> BertConfig:
    m = cfg.model
    base = BertConfig.from_json(m.config_file) if m.config_file else BertConfig.preset(m.preset)
    overrides = {
        k: getattr(m, k)
        for k in ("hidden_dropout_prob", "attention_probs_dropout_prob", "vocab_size")
        if getattr(m, k) is not None
    }
    if m.vocab_size is None and cfg.data.vocab_file:
        # A vocabulary trained with the data (the demo's) sets the model's size.
        try:
            with open(cfg.data.vocab_file, encoding="utf-8") as f:
                overrides["vocab_size"] = sum(1 for line in f if line.strip())
        except OSError as e:
            raise ConfigError(f"data.vocab_file: cannot read {cfg.data.vocab_file!r} ({e.strerror})") from None
    return replace(base, **overrides)


def map_large_allocations() -> None:
    """Give every allocation of 128 KiB or more its own mapping, returned to the OS when freed
    (glibc's M_MMAP_THRESHOLD, fixed; nothing where the C library has no ``mallopt``).

    Unpadded batches hold a different number of tokens every step, so every step allocates
    tensors of new sizes. By default glibc raises its mmap threshold (up to 32 MiB) as such
    blocks are freed, then serves them from the heap, whose freed pages it keeps: a 2-rank CPU
    run's resident memory crept up by 5% after its warm-up while Python's heap stayed flat.
    With the threshold fixed it stays flat (bench/soak.py; docs/reliability.md, "Endurance"),
    but every step's large tensors then fault in fresh pages: CPU training runs ~1.5x slower,
    so this is ``train.flat_host_memory``, off by default.
    """
    import ctypes

    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(ctypes.c_int(_M_MMAP_THRESHOLD), ctypes.c_int(128 << 10))


_M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def step_seed(seed: int, step: int, rank: int) -> int:
    return int(np.random.SeedSequence([seed, step, rank]).generate_state(1, dtype=np.uint64)[0] >> 1)


class Trainer:
    def __init__(self, cfg: RunConfig, output_dir: str, dist_info):
        """Builds every part but the data loaders: MLPerf's clock (``run_start``) starts
        before anything touches the dataset, so ``train()`` opens the data after it."""
        self.cfg = cfg
        self.out = output_dir
        self.rank, self.world = dist_info.rank, dist_info.world_size
        self.is_main = self.rank == 0
        self.device = self._pick_device(dist_info)
        self.coll = Collectives(self.rank, self.world, cfg.dist.timeout_s)
        t = cfg.train
        if t.global_batch_size % (self.world * t.grad_accum_steps):
            raise ConfigError(
                f"train.global_batch_size: {t.global_batch_size} is not divisible by ranks x "
                f"train.grad_accum_steps = {self.world} x {t.grad_accum_steps}"
            )
        if t.precision == "fp16" and self.device.type != "cuda":
            raise ConfigError("train.precision: fp16 needs CUDA (use bf16 or fp32 on the CPU)")
        self.local_batch = t.global_batch_size // self.world
        self.micro_batch = self.local_batch // t.grad_accum_steps
        self.eval_interval = eval_interval(cfg)
        for key, path in (("data.train_dir", cfg.data.train_dir), ("data.eval_file", cfg.data.eval_file)):
            if not path or not os.path.exists(path):  # a stat, not a read: the data stays untouched
                raise ConfigError(f"{key}: {path!r} does not exist")
        if self.is_main:
            try:
                os.makedirs(os.path.join(output_dir, "checkpoints"), exist_ok=True)
                probe = os.path.join(output_dir, ".write-test")
                open(probe, "w").close()
                os.remove(probe)
            except OSError as e:
                raise ConfigError(f"--output-dir: {output_dir!r} is not writable ({e.strerror})") from None

        # Counters; restored from a checkpoint when resuming.
        self.step = 0
        self.samples = 0
        self.tokens = 0
        self.skipped = 0
        self.nonfinite_in_row = 0
        self.corrupt_samples = 0
        self.checkpoint_failures = 0
        self.error: str | None = None  # why the run stopped early (summary "error", exit status 1)
        self.train_seconds = 0.0
        self.last_eval_samples = 0
        self.eval_accuracy: float | None = None
        self.stop_requested = False
        self.train_loader = None  # opened by train(), after run_start
        self.eval_loader = None
        self._loader_state: dict | None = None  # a resumed loader position, applied when the data opens

        self.progress = Progress(self.is_main, t.max_steps)
        found = self._find_checkpoint()
        self.resumed = found is not None
        # The run's seed: the config's, else one rank 0 draws from the OS; a resumed run keeps its own.
        self.seed = self._resolve_seed(found[1] if found else None)
        nodes = self._count_nodes(dist_info)
        platform = cfg.log.platform or (
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        )
        submitter = cfg.log.submitter or "unpadded-bert"  # only the open division may leave it empty
        self.mllog = MLPerfLogger(
            os.path.join(output_dir, "mlperf.log"),
            self.rank,
            cfg.log.division,
            submitter=submitter,
            platform=f"{nodes}x{platform}",
            resume=self.resumed,
        )
        if not self.resumed:
            # Initialisation (untimed, at most 30 minutes by the rules) starts here, before the
            # model is built; it ends after the warm-up in train().
            self.mllog.cache_clear(os.environ.get(CACHE_CLEARED_ENV) == "1")
            self.mllog.init_start()
            self._log_hyperparameters()

        if cfg.train.flat_host_memory:
            map_large_allocations()
        self.model_config = build_model_config(cfg)
        torch.manual_seed(self.seed)  # same initial weights on every rank
        options = (
            {"buckets": cfg.model.grouped_buckets, "num_streams": cfg.model.grouped_streams}
            if cfg.model.attention == "triton_grouped"
            else None
        )
        self.model = BertForPreTraining(
            self.model_config,
            attention=cfg.model.attention,
            fused_ops=cfg.model.fused_ops,
            attention_options=options,
            bias_gelu=cfg.model.bias_gelu,
        )
        fp8.convert_encoder(self.model, t.fp8, t.fp8_impl, self.device)
        if cfg.checkpoint.init:
            load_pretrained(self.model, cfg.checkpoint.init)
        self.model.to(self.device)
        self.ddp = None
        if self.world > 1:
            with self.coll.guard("the DDP setup (parameter broadcast)", -1):
                self.ddp = torch.nn.parallel.DistributedDataParallel(
                    self.model, device_ids=[self.device.index] if self.device.type == "cuda" else None
                )
        self.forward = self.ddp or self.model
        if cfg.model.compile:
            self.forward = torch.compile(self.forward)

        o = cfg.optim
        self.optimizer = build_optimizer(
            o.name, self.model, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.schedule = PolyWarmupScheduler(
            self.optimizer,
            base_lr=o.lr,
            total_steps=o.total_steps or t.max_steps,
            warmup_steps=o.warmup_steps,
            start_warmup_step=o.start_warmup_step,
            power=o.poly_power,
        )
        self.adagc = None
        if o.clip == "adagc":
            a = o.adagc
            self.adagc = AdaGC(
                self.model.named_parameters(),
                lambda_rel=a.lambda_rel,
                beta=a.beta,
                warmup_steps=a.warmup_steps,
                lambda_abs=a.lambda_abs,
                eps=a.eps,
            )
        self.clip_stats = None  # the last AdaGC step's, for the logs
        self.scaler = torch.amp.GradScaler("cuda") if t.precision == "fp16" else None
        self.autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]
        if cfg.data.max_seq_length > self.model_config.max_position_embeddings:
            raise ConfigError(
                f"data.max_seq_length: {cfg.data.max_seq_length} exceeds the model's "
                f"max_position_embeddings ({self.model_config.max_position_embeddings})"
            )

        self._collator = None
        self.rebalancer = None
        if self.world > 1 and cfg.data.rebalance != "none":
            from data.rebalance import Rebalancer

            with self.coll.guard("the rebalancer's settings check", -1):
                self.rebalancer = Rebalancer(
                    cfg.data.rebalance,
                    cfg.data.rebalance_cost,
                    batch_size=self.local_batch,
                    max_len=cfg.data.max_seq_length,
                    timeout_s=cfg.dist.timeout_s,
                    group_size=cfg.data.rebalance_group_size,
                )

        if found is not None:
            self._load_checkpoint_or_older(found)
        self.metrics = MetricsWriter(
            os.path.join(output_dir, "metrics.jsonl"), self.is_main, resume_step=self.step if self.resumed else None
        )
        if cfg.log.tensorboard and self.is_main:
            from bert.tensorboard_sink import TensorBoardSink

            self.metrics.sinks.append(
                TensorBoardSink(
                    os.path.join(output_dir, "tensorboard"),
                    cfg.to_dict(),
                    self.step if self.resumed else None,
                    self.metrics.records,
                )
            )

    # ---- setup helpers -------------------------------------------------------------------

    def _pick_device(self, dist_info) -> torch.device:
        want = self.cfg.train.device
        if want == "cpu" or (want == "auto" and not torch.cuda.is_available()):
            return torch.device("cpu")
        if not torch.cuda.is_available():
            raise ConfigError("train.device: 'cuda' asked for, but CUDA is not available")
        return dist_info.device if dist_info.device.type == "cuda" else torch.device("cuda", 0)

    def _warn(self, message: str) -> None:
        """A warning every rank may have (a corrupt shard is found by the rank that reads it)."""
        print(f"warning (rank {self.rank}): {message}" if self.world > 1 else f"warning: {message}", flush=True)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.autocast_dtype)

    def _collate(self, block: SampleBlock):
        """SampleBlock -> the configured batch layout, by the configured backend (torch, dali)."""
        if self._collator is None:
            # DALI collates on this rank's GPU when there is one; torch collates on the CPU
            # and the batch is moved with a non-blocking copy.
            device_id = self.device.index if self.cfg.data.backend == "dali" and self.device.type == "cuda" else None
            self._collator = make_collator(
                self.cfg.data.backend,
                self.cfg.data.layout,
                self.cfg.data.max_seq_length,
                device_id,
                max_batch_size=max(self.micro_batch, self.cfg.eval.batch_size),
            )
        return self._collator(block)

    # ---- the named steps -----------------------------------------------------------------

    def train_step(self, block: SampleBlock) -> StepResult:
        """Forward and backward over this rank's micro-batches of one global batch."""
        torch.manual_seed(step_seed(self.seed, self.step, self.rank))
        # One all-reduce gives the global counts the losses are normalised by, and lets any
        # rank's stop request (SIGTERM) reach all ranks at the same step.
        simreg = self.cfg.loss.simreg_weight > 0
        anchors = (
            simreg_anchor_count(
                block.seq_lens,
                block.input_ids,
                block.masked_positions,
                block.masked_ids,
                block.masked_counts,
                self.cfg.loss.simreg_scope,
            )
            if simreg
            else 0
        )
        counts = torch.tensor(
            [
                int(block.masked_counts.sum()),
                len(block),
                block.num_tokens,
                int(self.stop_requested),
                anchors,
                self.train_loader.pop_substituted(self.step),
            ],
            dtype=torch.int64,
        )
        counts = self.coll.all_reduce(counts.to(self.device), "the step-counts all-reduce", self.step + 1).cpu()
        num_masked, num_seqs, tokens, stops, num_anchors, corrupt = (int(x) for x in counts)
        self.stop_requested = stops > 0
        # DDP all-reduces the gradients inside the last micro-batch's backward.
        with self.coll.guard("the gradient all-reduce (DDP backward)", self.step + 1):
            loss_parts = self.forward_backward(block, num_masked, num_seqs, num_anchors)
        return StepResult(loss_parts, num_seqs, tokens, corrupt)

    def forward_backward(self, block: SampleBlock, num_masked: int, num_seqs: int, num_anchors: int) -> torch.Tensor:
        """This rank's micro-batches through forward and backward; returns the [4] loss parts."""
        t = self.cfg.train
        simreg = self.cfg.loss.simreg_weight > 0
        self.forward.train()
        loss_parts = torch.zeros(4, device=self.device)
        scale = float(self.world)  # DDP averages gradients over ranks; the losses are sums
        for i in range(t.grad_accum_steps):
            mb = block.select(np.arange(i * self.micro_batch, (i + 1) * self.micro_batch))
            batch = self._collate(mb).to(self.device, non_blocking=True)
            sync = self.ddp is None or i == t.grad_accum_steps - 1
            with contextlib.nullcontext() if sync else self.ddp.no_sync(), self._autocast():
                out = self.forward(batch)
                loss, stats = pretraining_loss(
                    out.mlm_logits, batch.mlm_labels, out.nsp_logits, batch.nsp_labels, num_masked, num_seqs
                )
                simreg_part = torch.zeros((), device=self.device)
                if simreg:
                    hidden, sim_batch = out.hidden_states, batch
                    if isinstance(batch, PackedBatch):  # SimReg looks at real tokens only
                        sim_batch, index = unpack(batch)
                        hidden = hidden[index]
                    reg_sum, _ = simreg_loss(
                        hidden, sim_batch, self.cfg.loss.simreg_temperature, self.cfg.loss.simreg_scope
                    )
                    simreg_part = reg_sum / max(num_anchors, 1)
                    loss = loss + self.cfg.loss.simreg_weight * simreg_part
            backward_loss = loss * scale
            (self.scaler.scale(backward_loss) if self.scaler else backward_loss).backward()
            loss_parts += torch.stack(
                [
                    loss.detach(),
                    stats["mlm_loss_sum"] / max(num_masked, 1),
                    stats["nsp_loss_sum"] / max(num_seqs, 1),
                    simreg_part.detach(),
                ]
            )
        return loss_parts

    def optimizer_step(self) -> tuple[bool, float]:
        """Clip, skip a non-finite update, step LAMB and the schedule. Returns (applied, grad norm)."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        self._inject_debug_faults()
        if self.adagc is not None:
            # AdaGC needs no global norm to clip; the sum of its per-tensor norms is kept for
            # the non-finite check and the logs.
            self.clip_stats = self.adagc.clip_(compute_global_norm=True)
            norm = self.clip_stats.global_norm
        elif self.cfg.optim.clip == "global":
            norm = clip_global_(params, self.cfg.optim.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm([p.grad for p in params])))
        # The one host sync of the step: the update must not run on non-finite gradients.
        grad_norm = float(norm)
        applied = math.isfinite(grad_norm)
        if applied:
            if self.scaler:
                self.scaler.step(self.optimizer)
            else:
                self.optimizer.step()
            self.schedule.step()
            self.nonfinite_in_row = 0
        else:
            self.skipped += 1
            self.nonfinite_in_row += 1
            if self.adagc is not None:
                # AdaGC kept its thresholds on the non-finite step but counted it; the skipped
                # step leaves all optimizer state as it was, its step count included.
                self.adagc.step -= 1
        if self.scaler:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return applied, grad_norm

    @torch.no_grad()
    def _inject_debug_faults(self) -> None:
        """debug.*: multiply chosen gradients at chosen steps, or make one non-finite."""
        d = self.cfg.debug
        step = self.step + 1  # the update being prepared, 1-based
        if step in d.spike_steps:
            for name, p in self.model.named_parameters():
                if p.grad is not None and (not d.spike_params or any(s in name for s in d.spike_params)):
                    p.grad.mul_(d.spike_factor)
        if step in d.nonfinite_steps:
            next(p for p in self.model.parameters() if p.grad is not None).grad.view(-1)[0] = float(d.nonfinite_value)

    @torch.no_grad()
    def evaluate(self) -> float:
        """Masked-LM accuracy over the whole eval set (counts all-reduced over ranks)."""
        self.model.eval()
        correct = torch.zeros((), dtype=torch.int64, device=self.device)
        total = torch.zeros((), dtype=torch.int64, device=self.device)
        for block in self.eval_loader:
            batch = self._collate(block).to(self.device, non_blocking=True)
            with self._autocast():
                out = self.model(batch)
            correct += (out.mlm_logits.argmax(-1) == batch.mlm_labels).sum()
            total += batch.mlm_labels.numel()
        counts = self.coll.all_reduce(torch.stack([correct, total]), "the eval-accuracy all-reduce", self.step)
        return float(counts[0]) / max(int(counts[1]), 1)

    # ---- the loop ------------------------------------------------------------------------

    def train(self) -> dict:
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        try:
            return self._train()
        finally:
            signal.signal(signal.SIGTERM, previous)
            if self.train_loader is not None:
                self.train_loader.close()
            self.metrics.close()

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True

    def _log_hyperparameters(self) -> None:
        cfg, t, o = self.cfg, self.cfg.train, self.cfg.optim
        self.mllog.submission_info()
        self.mllog.hyperparameters(
            seed=self.seed,
            global_batch_size=t.global_batch_size,
            local_batch_size=self.micro_batch,
            gradient_accumulation_steps=t.grad_accum_steps,
            max_sequence_length=cfg.data.max_seq_length,
            max_predictions_per_seq=cfg.data.max_predictions_per_seq,
            learning_rate=o.lr,
            betas=o.betas,
            epsilon=o.eps,
            weight_decay=o.weight_decay,
            warmup_steps=o.warmup_steps,
            start_warmup_step=o.start_warmup_step,
            train_steps=o.total_steps or t.max_steps,
            poly_power=o.poly_power,
        )
        self.mllog.precision(
            linear=fp8.mlperf_precision(t.fp8, t.precision), attention=fp8.mlperf_precision("off", t.precision)
        )

    def _log_start(self) -> None:
        """Warm up, end initialisation, start the clock, then open the data."""
        log = self.mllog
        if self.resumed:
            self._clock_started = time.time()
            self._open_data()
            self.progress.message(f"resumed from step {self.step} ({self.samples} samples)")
            log.epoch_start(self.samples)
            return
        self.warm_up()
        if self.cfg.eval.at_start:
            self.evaluate_at_start()
        log.init_stop()
        log.run_start()
        self._clock_started = time.time()  # the summary's time to train counts from here, as MLPerf's
        self._open_data()
        log.epoch_start(0)

    def warm_up(self) -> None:
        """Forward and backward on synthetic batches before the clock starts, so that kernel
        compilation and autotuning (Triton, torch.compile) and the allocator's first growth
        are not timed. It leaves no trace: no optimizer step, gradients dropped, RNG states
        restored. On a GPU: one micro-batch at full length (the allocator's worst case) and
        one of mixed lengths (the other length buckets' kernels); on a CPU one tiny step."""
        cuda = self.device.type == "cuda"
        cpu_rng = torch.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state(self.device) if cuda else None
        vocab, seq = self.model_config.vocab_size, self.cfg.data.max_seq_length
        predictions = min(self.cfg.data.max_predictions_per_seq, max(1, seq // 8))
        if cuda:
            n = self.micro_batch
            blocks = [
                random_block(n, seed=0, max_seq_length=seq, max_predictions=predictions, vocab_size=vocab, min_len=seq),
                random_block(n, seed=1, max_seq_length=seq, max_predictions=predictions, vocab_size=vocab),
            ]
        else:
            short = min(seq, 16)
            blocks = [
                random_block(
                    2,
                    seed=0,
                    max_seq_length=short,
                    max_predictions=min(predictions, 2),
                    vocab_size=vocab,
                    min_len=min(8, short),
                )
            ]
        self.forward.train()
        for block in blocks:
            batch = self._collate(block).to(self.device, non_blocking=True)
            with self._autocast():
                out = self.forward(batch)
                loss, _ = pretraining_loss(
                    out.mlm_logits,
                    batch.mlm_labels,
                    out.nsp_logits,
                    batch.nsp_labels,
                    int(block.masked_counts.sum()),
                    len(block),
                )
            with self.coll.guard("the warm-up's gradient all-reduce", 0):
                loss.backward()
        self.optimizer.zero_grad(set_to_none=True)
        self.model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.set_rng_state(cuda_rng, self.device)
        torch.set_rng_state(cpu_rng)

    def evaluate_at_start(self) -> None:
        """eval.at_start: the initial weights' accuracy, before the clock (open division only)."""
        self.eval_loader = self._eval_loader()
        acc = self.evaluate()
        self.metrics.write({"step": 0, "samples": 0, "eval_at_start_accuracy": acc})
        self.progress.message(f"eval at start (initial weights, not timed)  masked-LM accuracy {acc:.4f}")

    def _eval_loader(self):
        from data.loader import EvalLoader

        return EvalLoader(
            self.cfg.data.eval_file,
            rank=self.rank,
            world_size=self.world,
            batch_size=self.cfg.eval.batch_size,
            max_samples=self.cfg.eval.max_samples,
            vocab_size=self.model_config.vocab_size,
            backend=self.cfg.data.backend,
        )

    def _open_data(self) -> None:
        """The loaders: the first reads of the dataset, after run_start."""
        from data.hdf5io import inspect
        from data.loader import PretrainingLoader

        cfg, t = self.cfg, self.cfg.train
        # Both loaders check every token id against the model's vocabulary as they read.
        vocab = self.model_config.vocab_size
        self.train_loader = PretrainingLoader(
            cfg.data.train_dir,
            global_batch_size=t.global_batch_size,
            rank=self.rank,
            world_size=self.world,
            seed=self.seed,
            backend=cfg.data.backend,
            vocab_size=vocab,
            on_corrupt=cfg.data.on_corrupt,
            warn=self._warn,
        )
        if self._loader_state is not None:
            self.train_loader.load_state_dict(self._loader_state)
        if self.eval_loader is None:  # eval.at_start opened it already
            self.eval_loader = self._eval_loader()
        if cfg.log.division == "closed" and self.eval_loader.total_samples != CLOSED_EVAL_SAMPLES:
            raise ConfigError(
                f"data.eval_file: the closed division evaluates on exactly {CLOSED_EVAL_SAMPLES:,} "
                f"samples; {cfg.data.eval_file} holds {self.eval_loader.total_samples:,}"
            )
        self.data_info = inspect(self.train_loader.files[0])
        seq = self.data_info.max_seq_length
        if seq is not None and seq > cfg.data.max_seq_length:
            raise ConfigError(
                f"data.max_seq_length: {cfg.data.max_seq_length}, but {self.data_info.path} holds "
                f"sequences of up to {seq} tokens"
            )
        predictions = self.data_info.max_predictions
        if predictions is not None and predictions > cfg.data.max_predictions_per_seq:
            raise ConfigError(
                f"data.max_predictions_per_seq: {cfg.data.max_predictions_per_seq}, but "
                f"{self.data_info.path} holds up to {predictions} masked positions per sequence"
            )

    def _train(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        self._log_start()
        interval = self.eval_interval
        status = None
        run_start = self._clock_started - self.train_seconds
        # NVIDIA's v4.0 numbering: one block over the whole run, first_epoch_num 1 and
        # epoch_count 1; evaluations inside it carry the samples trained as epoch_num.
        self.mllog.block_start(self.samples if self.resumed else 1, 1)
        window_start, window_samples, window_tokens = time.time(), 0, 0
        batches = iter(self.train_loader)
        if self.rebalancer:
            self.rebalancer.start(next(batches), step=self.step)
        while status is None:
            rebalance = None
            if self.rebalancer:
                # This step's samples, exchanged while the previous step computed; the next
                # step's exchange now runs behind this one.
                with self.coll.guard("the rebalancing exchange", self.step + 1):
                    block, rebalance = self.rebalancer.wait()
                self.rebalancer.start(next(batches), step=self.step + 1)
            else:
                block = next(batches)
            step_start = time.time()
            result = self.train_step(block)
            applied, grad_norm = self.optimizer_step()
            self.step += 1
            self.samples += result.samples
            self.tokens += result.tokens
            if result.corrupt:
                self.corrupt_samples += result.corrupt
                self.progress.message(
                    f"warning: step {self.step}: {result.corrupt} corrupt sample(s) replaced by the "
                    f"next valid ones (data.on_corrupt=skip); {self.corrupt_samples} so far"
                )
            self.train_seconds += time.time() - step_start
            window_samples += result.samples
            window_tokens += result.tokens
            if self.nonfinite_in_row >= t.max_nonfinite_steps:
                self.progress.message(
                    f"error: {self.nonfinite_in_row} non-finite losses in a row at step "
                    f"{self.step}; stopping (status aborted)"
                )
                status = "aborted"
            if self.step % t.log_interval_steps == 0 or self.step == 1:
                parts = self.coll.all_reduce(result.loss_parts.clone(), "the loss all-reduce", self.step).tolist()
                elapsed = max(time.time() - window_start, 1e-9)
                rec = {
                    "step": self.step,
                    "samples": self.samples,
                    "loss": parts[0],
                    "mlm_loss": parts[1],
                    "nsp_loss": parts[2],
                    **({"simreg_loss": parts[3]} if self.cfg.loss.simreg_weight else {}),
                    "lr": self.schedule.lr_at(max(self.schedule.step_count - 1, 0)),
                    "grad_norm": grad_norm,
                    "seq_per_s": window_samples / elapsed,
                    "tokens_per_s": window_tokens / elapsed,
                    "skipped_steps": self.skipped,
                    **self._adagc_record(),
                    **({"corrupt_samples": self.corrupt_samples} if cfg.data.on_corrupt == "skip" else {}),
                }
                if rebalance is not None:
                    rec["rebalance"] = {
                        k: getattr(rebalance, k)
                        for k in (
                            "imbalance_before",
                            "imbalance_after",
                            "samples_moved",
                            "samples_sent",
                            "exchange_ms",
                            "wait_ms",
                            "hidden_fraction",
                        )
                    }
                self.metrics.write(rec)
                self.progress.step(rec)
                window_start, window_samples, window_tokens = time.time(), 0, 0
            crossed = self.samples // interval > self.last_eval_samples // interval
            at_limit = self.step >= t.max_steps or self.samples >= t.max_samples
            if crossed or (at_limit and self.last_eval_samples != self.samples):
                self._run_eval()
                if self.eval_accuracy >= cfg.eval.target_accuracy:
                    status = "success"
            if status is None and at_limit:
                status = "aborted"
            ckpt_due = cfg.checkpoint.interval_steps and self.step % cfg.checkpoint.interval_steps == 0
            if status is None and (ckpt_due or self.stop_requested):
                saved = self.save_checkpoint()
                if self.stop_requested:
                    self._drain_rebalancer()
                    self.progress.message(
                        f"stopping at step {self.step} as asked (SIGTERM); "
                        + (
                            "checkpoint saved, rerun with the same --output-dir to resume"
                            if saved
                            else "rerun with the same --output-dir to resume from the latest checkpoint"
                        )
                    )
                    self.mllog.close()
                    return {
                        "status": "interrupted",
                        "steps": self.step,
                        "samples": self.samples,
                        **({"error": self.error} if self.error else {}),
                    }
                if not saved and cfg.checkpoint.on_error == "stop":
                    status = "aborted"
        time_to_train = time.time() - run_start
        if cfg.checkpoint.at_end:
            self.save_checkpoint()
        return self._finish(status, time_to_train)

    def _adagc_record(self) -> dict:
        """The last AdaGC step's share of clipped tensors and mean clip factor (for the logs)."""
        c = self.clip_stats
        if c is None or not c.num_tensors:
            return {}
        return {"adagc_clipped_share": int(c.num_clipped) / c.num_tensors, "adagc_clip_ratio": float(c.clip_ratio)}

    def _run_eval(self) -> None:
        self.mllog.eval_start(self.samples)
        acc = self.evaluate()
        self.eval_accuracy = acc
        self.last_eval_samples = self.samples
        self.mllog.eval_accuracy(self.samples, acc)
        self.mllog.eval_stop(self.samples)
        self.metrics.write({"step": self.step, "samples": self.samples, "eval_accuracy": acc})
        self.progress.message(
            f"eval  step {self.step:>6}  samples {self.samples:>9}  masked-LM accuracy {acc:.4f}"
            f"  (target {self.cfg.eval.target_accuracy})"
        )

    def _drain_rebalancer(self) -> None:
        """Collect the exchange started for a step that will not run (every rank started it)."""
        if self.rebalancer and self.rebalancer.pending:
            self.rebalancer.wait()

    def _finish(self, status: str, time_to_train: float) -> dict:
        self._drain_rebalancer()
        log = self.mllog
        if "block" in log._open:
            log.block_stop(self.samples)
        log.epoch_stop(self.samples)
        log.train_samples(self.samples)
        log.eval_samples(self.eval_loader.total_samples)
        log.run_stop(self.samples, status)
        log.close()
        summary = {
            "status": status,
            "steps": self.step,
            "samples": self.samples,
            "train_seconds": self.train_seconds,
            "seq_per_s": self.samples / max(self.train_seconds, 1e-9),
            "tokens_per_s": self.tokens / max(self.train_seconds, 1e-9),
            "eval_accuracy": self.eval_accuracy,
            "time_to_train_s": time_to_train,
            "skipped_steps": self.skipped,
            "world_size": self.world,
            "corrupt_samples_skipped": self.corrupt_samples,
            "checkpoint_failures": self.checkpoint_failures,
            "loss_spike_score": spike_score([r["loss"] for r in self.metrics.records if "loss" in r]),
            "grad_norm_spike_score": spike_score([r["grad_norm"] for r in self.metrics.records if "grad_norm" in r]),
            **({"error": self.error} if self.error else {}),
        }
        if self.is_main:
            import json

            atomic_write_text(os.path.join(self.out, "summary.json"), json.dumps(summary, indent=2) + "\n")
            if self.cfg.log.plot:
                plot_curves(self.metrics.records, os.path.join(self.out, "curves.png"))
            self.progress.message("\nsummary\n" + summary_table(summary))
        return summary

    # ---- checkpoints ---------------------------------------------------------------------

    def _checkpoint_dir(self) -> str:
        return os.path.join(self.out, "checkpoints")

    def save_checkpoint(self) -> bool:
        """Rank 0 writes the checkpoint; every rank learns whether it worked. Returns success.

        A write the file system refuses is reported with the checkpoint that is kept instead;
        the caller goes on or stops by checkpoint.on_error.
        """
        error = None
        if self.is_main:
            try:
                train_checkpoint.save(
                    self._checkpoint_dir(), self.step, self._training_state(), self.cfg.checkpoint.keep
                )
            except train_checkpoint.CheckpointWriteError as e:
                error = str(e)
        failed = self.coll.all_reduce(
            torch.tensor([int(error is not None)], device=self.device), "the checkpoint commit", self.step
        )
        if not int(failed):
            return True
        self.checkpoint_failures += 1
        if self.is_main:
            kept = train_checkpoint.list_checkpoints(self._checkpoint_dir())
            previous = os.path.basename(kept[-1][1]) if kept else "none"
            action = "continuing" if self.cfg.checkpoint.on_error == "continue" else "stopping"
            self.progress.message(
                f"error: step {self.step}: {error}; the previous checkpoint ({previous}) is kept; "
                f"{action} (checkpoint.on_error={self.cfg.checkpoint.on_error})"
            )
        if self.cfg.checkpoint.on_error == "stop" or self.stop_requested:
            self.error = f"the checkpoint of step {self.step} could not be written" + (f": {error}" if error else "")
        return False

    def _training_state(self) -> dict:
        # The rebalancer has already drawn the next step's samples from the loader: the
        # position to resume at is the number of steps trained.
        loader = {**self.train_loader.state_dict(), "step": self.step}
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "schedule": self.schedule.state_dict(),
            "adagc": self.adagc.state_dict() if self.adagc else None,
            "scaler": self.scaler.state_dict() if self.scaler else None,
            "loader": loader,
            "counters": {
                "step": self.step,
                "samples": self.samples,
                "tokens": self.tokens,
                "skipped": self.skipped,
                "nonfinite_in_row": self.nonfinite_in_row,
                "train_seconds": self.train_seconds,
                "last_eval_samples": self.last_eval_samples,
                "eval_accuracy": self.eval_accuracy,
                "corrupt_samples": self.corrupt_samples,
                "checkpoint_failures": self.checkpoint_failures,
                "seed": self.seed,
            },
            "config": self.cfg.to_dict(),
        }

    def _find_checkpoint(self) -> tuple[str, dict] | None:
        """The newest checkpoint that verifies (damaged ones are named and passed over), as
        (path, state); checks that every rank found the same step. None: start fresh."""
        directory = self._checkpoint_dir()
        if self.is_main and os.path.isdir(directory):
            for name in train_checkpoint.remove_temporaries(directory):
                self.progress.message(f"removed {name}, the unfinished write of a killed run")
        # The model does not exist yet (the seed it is built with may come from the checkpoint):
        # whether the state fits it is checked when it is loaded (_load_checkpoint_or_older).
        found = (
            train_checkpoint.load_latest(directory, warn=self.progress.message) if os.path.isdir(directory) else None
        )
        step = found[1]["counters"]["step"] if found is not None else 0
        # Ranks that see different checkpoint directories (node-local disks) would diverge silently.
        steps = self.coll.all_reduce(
            torch.tensor([step, -step], device=self.device), "the resume check", step, op=dist.ReduceOp.MAX
        )
        if int(steps[0]) != -int(steps[1]):
            raise CheckpointError(
                f"{directory}: the ranks resumed from different steps ({-int(steps[1])} to "
                f"{int(steps[0])}; rank {self.rank} from {step}): every rank must see the "
                f"same checkpoints"
            )
        return found

    def _resolve_seed(self, state: dict | None) -> int:
        """train.seed, or (unset) a seed rank 0 draws from the OS, the same on every rank; a
        resumed run keeps the seed it started with."""
        if state is not None and state["counters"].get("seed") is not None:
            return int(state["counters"]["seed"])
        if self.cfg.train.seed is not None:
            return self.cfg.train.seed
        drawn = secrets.randbits(31) if self.is_main else 0
        drawn = self.coll.all_reduce(
            torch.tensor([drawn], dtype=torch.int64, device=self.device), "the seed broadcast", 0
        )
        return int(drawn)

    def _count_nodes(self, dist_info) -> int:
        """Nodes in the job (for submission_platform): ranks with local rank 0."""
        first = torch.tensor([int(dist_info.local_rank == 0)], dtype=torch.int64, device=self.device)
        return max(1, int(self.coll.all_reduce(first, "the node count", 0)))

    def _check_checkpoint(self, state: dict) -> None:
        """Refuse (CheckpointError) a state whose tensors do not fit this model and optimizer,
        before anything is loaded: load_state_dict would copy other dtypes silently, and a
        moment of the wrong shape would only fail at the next step."""
        for key in ("model", "optimizer", "schedule", "loader", "counters"):
            if not isinstance(state.get(key), dict):
                raise CheckpointError(f"no {key!r} state")
        ours, theirs = self.model.state_dict(), state["model"]
        problems = [f"missing {k}" for k in ours if k not in theirs]
        problems += [f"unexpected {k}" for k in theirs if k not in ours]
        for k, t in theirs.items():
            want = ours.get(k)
            if want is not None and (not isinstance(t, torch.Tensor) or t.shape != want.shape or t.dtype != want.dtype):
                got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                problems.append(f"{k} is {got}, the model has {want.dtype} {tuple(want.shape)}")
        if problems:
            raise CheckpointError(
                f"the model weights do not fit this model ({'; '.join(problems[:4])}"
                + (f"; +{len(problems) - 4} more" if len(problems) > 4 else "")
                + ")"
            )
        groups, saved = self.optimizer.param_groups, state["optimizer"]
        try:
            sizes = [len(g["params"]) for g in saved["param_groups"]]
            params = dict(
                zip((i for g in saved["param_groups"] for i in g["params"]), (p for g in groups for p in g["params"]))
            )
            moments = dict(saved["state"])
        except (KeyError, TypeError, ValueError):
            raise CheckpointError("the optimizer state is not param_groups with params, and state") from None
        if sizes != [len(g["params"]) for g in groups]:
            raise CheckpointError(
                f"the optimizer state has parameter groups of sizes {sizes}, this optimizer "
                f"{[len(g['params']) for g in groups]}"
            )
        for i, entry in moments.items():
            if i not in params or not isinstance(entry, dict):
                raise CheckpointError(f"the optimizer state names parameter {i!r}, which it has no group for")
            for name, t in entry.items():
                if (
                    isinstance(t, torch.Tensor)
                    and t.dim()
                    and (t.shape != params[i].shape or not t.is_floating_point())
                ):
                    raise CheckpointError(
                        f"the optimizer's {name} of parameter {i} is {t.dtype} {tuple(t.shape)}, "
                        f"the parameter {params[i].dtype} {tuple(params[i].shape)}"
                    )
        c = state["counters"]
        for key in ("step", "samples", "tokens", "skipped", "nonfinite_in_row", "last_eval_samples"):
            if not isinstance(c.get(key), int) or isinstance(c.get(key), bool) or c[key] < 0:
                raise CheckpointError(f"counter {key!r} is {c.get(key)!r}, not an integer >= 0")
        if not isinstance(c.get("train_seconds"), (int, float)):
            raise CheckpointError(f"counter 'train_seconds' is {c.get('train_seconds')!r}, not a number")

    def _load_checkpoint_or_older(self, found: tuple[str, dict]) -> None:
        """Load ``found``; a checkpoint that does not fit this run is refused like a damaged
        one and the next older one is tried (CheckpointError when none is left)."""
        path, state = found
        try:
            self._load_checkpoint(state)
            return
        except CheckpointError as e:
            self.progress.message(f"warning: {path}: {e}; trying the previous checkpoint")
        older = train_checkpoint.load_latest(
            self._checkpoint_dir(), warn=self.progress.message, accept=self._load_checkpoint, older_than=path
        )
        if older is None:
            raise CheckpointError(
                f"every checkpoint in {self._checkpoint_dir()} is damaged or refused ({path} does "
                f"not fit this run); move them away to start the run over"
            )

    def _load_checkpoint(self, state: dict) -> None:
        """Check the state against this run, then load it; CheckpointError when it does not fit
        (parts loaded before the failing one are overwritten by the next checkpoint tried)."""
        self._check_checkpoint(state)
        try:
            # Each part's load_state_dict checks its input before changing anything.
            if self.adagc is not None and state.get("adagc"):
                self.adagc.load_state_dict(state["adagc"])
            if self.scaler and state.get("scaler"):
                self.scaler.load_state_dict(state["scaler"])
            self.schedule.load_state_dict(state["schedule"])
            self.optimizer.load_state_dict(state["optimizer"])
        except (ValueError, KeyError, TypeError, RuntimeError) as e:  # DataError is a ValueError
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise CheckpointError(f"does not fit this run ({first})") from None
        self.model.load_state_dict(state["model"])
        self._loader_state = state["loader"]  # checked when the data opens, after run_start
        c = state["counters"]
        self.step, self.samples, self.tokens, self.skipped = c["step"], c["samples"], c["tokens"], c["skipped"]
        self.nonfinite_in_row, self.train_seconds = c["nonfinite_in_row"], c["train_seconds"]
        self.last_eval_samples, self.eval_accuracy = c["last_eval_samples"], c.get("eval_accuracy")
        self.corrupt_samples = c.get("corrupt_samples", 0)
        self.checkpoint_failures = c.get("checkpoint_failures", 0)
