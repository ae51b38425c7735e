"""The training loop: named steps from a global batch to an MLPerf result.

``Trainer(cfg, output_dir, dist_info).train()`` builds its parts (``bert.train.build``), resumes from
``output_dir/checkpoints`` and runs per global step ``train_step`` and ``optimizer_step``, ``evaluate`` every eval
interval and ``save_checkpoint`` at its interval and on SIGTERM; a step reads nothing back from the device. How and
why: docs/training.md, "The training loop", and docs/step.md.

Shape legend as in ``bert.model``: T tokens, B sequences, M masked positions.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import time
from dataclasses import dataclass

import numpy as np
import torch

from bert.checkpoint.pretrained import load_pretrained
from bert.checkpoint.training import find_checkpoint, restore, resume, to_checkpoint, write_checkpoint
from bert.config import DebugSection, RunConfig, build_model_config, eval_interval
from bert.distributed.collectives import Collectives
from bert.distributed.context_parallel import ContextPool
from bert.distributed.fault_tolerance import FaultTolerance, Quorum, ReplicaPlanner, replica_number
from bert.distributed.host_counts import CountAgreement, StepPlanner
from bert.optim.clipping import clip_global_, tensor_norms
from bert.optim.optimizers import apply_update
from bert.optim.shard import apply_sharding, local_shard, reshard
from bert.report import metrics as reporting
from bert.report.metrics import DeviceCounters, Progress
from bert.state import TrainState, resolve_seed, seed_step
from bert.train import build as components
from bert.train.evaluate import EvalBatches, masked_lm_counts
from bert.train.losses import pretraining_loss, simreg_term
from bert.train.step_timer import StepTimer
from common.errors import ConfigError
from data.batch import to_device
from data.samples import SampleBlock
from kernels.runtime import philox_from, philox_state

# Set to 1 by launch/run_and_time.sh when it dropped the page cache before this run (the
# log's cache_clear says what really happened).
CACHE_CLEARED_ENV = "MLPERF_CACHE_CLEARED"


@dataclass
class StepResult:
    loss_parts: torch.Tensor  # [4] local: loss, mlm loss, nsp loss, simreg (each / global count)
    samples: int  # global
    tokens: int  # global
    corrupt: int = 0  # global: corrupt samples replaced in this step's batch (data.on_corrupt=skip)


def map_large_allocations() -> None:
    """train.flat_host_memory: every allocation of 128 KiB or more gets its own mapping, returned to the OS when freed
    (glibc's M_MMAP_THRESHOLD, -3, fixed; nothing without ``mallopt``). Cost: docs/reliability.md, "Endurance"."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(ctypes.c_int(-3), ctypes.c_int(128 << 10))


@torch.no_grad()
def inject_debug_faults(debug: DebugSection, model: torch.nn.Module, step: int) -> None:
    """debug.*: before update ``step`` (1-based), multiply chosen gradients, or make one non-finite."""
    if step in debug.spike_steps:
        for name, p in model.named_parameters():
            if p.grad is not None and (not debug.spike_params or any(s in name for s in debug.spike_params)):
                p.grad.mul_(debug.spike_factor)
    if step in debug.nonfinite_steps:
        # Sharded: the rank holding the first element of the first gradient writes it.
        grad = local_shard(next(p for p in model.parameters() if p.grad is not None).grad)
        if grad.numel():
            grad.view(-1)[0] = float(debug.nonfinite_value)


class Trainer:
    ft: FaultTolerance | None = None  # dist.fault_tolerance=torchft's manager, built last by __init__
    ft_rank = 0  # this replica's rank in the last quorum (rank 0 writes the checkpoints)

    def __init__(self, cfg: RunConfig, output_dir: str, dist_info):
        """Builds every part but the data loaders, which ``train()`` opens after MLPerf's clock starts (run_start)."""
        self.cfg, t = cfg, cfg.train
        self.rank, self.world, self.is_main = dist_info.rank, dist_info.world_size, dist_info.rank == 0
        self.device = components.build_device(cfg, dist_info, output_dir)
        self.checkpoint_dir = os.path.join(output_dir, "checkpoints")
        self.out = self._replica_dir(output_dir) if cfg.dist.fault_tolerance == "torchft" else output_dir
        self.coll = Collectives(self.rank, self.world, cfg.dist.timeout_s)
        self.local_batch = t.global_batch_size // self.world
        self.micro_batch = self.local_batch // t.grad_accum_steps
        self.eval_interval = eval_interval(cfg)
        self.state = TrainState()  # the counters; restored from a checkpoint when resuming
        self.error: str | None = None  # why the run stopped early (summary "error", exit status 1)
        self.stop_requested = self.stop_agreed = False  # this rank's SIGTERM; every rank's, after this step
        self.train_loader = self.eval_loader = self.planner = self._collator = None  # opened by train()
        self.shapes_seen: set[tuple[int, int]] = set()  # (tokens, masked) of the micro-batches run
        self.progress = Progress(self.is_main, t.max_steps)
        found = find_checkpoint(self.checkpoint_dir, self.coll, self.device, self.progress.message)
        self.resumed = found is not None
        # The run's seed: the config's, else one rank 0 draws from the OS; a resumed run keeps its own.
        self.state.seed = resolve_seed(t.seed, found[1] if found else None, self.coll, self.device)
        self._start_mlperf_log(dist_info)  # initialisation starts before the model is built
        self._build_model()
        self.optimizer, self.schedule, self.adagc, self.scaler = components.build_optimization(
            cfg, self.model, self.sharding, self.device
        )
        self.rebalancer = self._build_rebalancer() if self.world > 1 else None
        self.agreement = CountAgreement(self.world, cfg.dist.timeout_s)  # after the rebalancer's group
        graphed = self.static if t.cuda_graphs else None  # graphed eval replays padded shapes
        self.eval_batches = EvalBatches(cfg.eval, self.device, self._collate, self.progress.message, graphed)
        # What a checkpoint saves and restores besides the counters (bert.state).
        self.parts = {"model": self.model, "optimizer": self.optimizer, "schedule": self.schedule}
        self.parts.update(adagc=self.adagc, scaler=self.scaler)
        self._loader_state = self._resume(found) if found is not None else None  # applied when the data opens
        self.counters = DeviceCounters(self.device, self.state.skipped, self.state.nonfinite_in_row)
        resume_step = self.state.step if self.resumed else None
        self.metrics = components.build_metrics(cfg.log, self.out, self.is_main, resume_step, cfg.to_dict())
        if cfg.dist.fault_tolerance == "torchft":  # this replica's manager, at the step it starts from
            give, take = self._replica_state, self._load_replica_state
            self.ft = FaultTolerance(cfg.dist, self.device, give, take, self.state.step)

    def _replica_dir(self, output_dir: str) -> str:
        """dist.fault_tolerance: OUT/replica_<id>, where this replica logs (the checkpoints stay in OUT/checkpoints)."""
        if self.world > 1:
            raise ConfigError(
                f"dist.fault_tolerance: a replica group is one rank; start each replica as its own process "
                f"(launch/run_torchrun.sh with FT_REPLICAS), not {self.world} ranks in one group"
            )
        out = os.path.join(output_dir, f"replica_{replica_number()}")
        os.makedirs(out, exist_ok=True)
        return out

    def _start_mlperf_log(self, dist_info) -> None:
        """mlperf.log; a fresh run's initialisation (untimed, at most 30 minutes) starts here."""
        first = torch.tensor([int(dist_info.local_rank == 0)], dtype=torch.int64, device=self.device)
        nodes = max(1, int(self.coll.all_reduce(first, "the node count", 0)))  # for submission_platform
        self.mllog = components.build_mlperf_logger(self.cfg.log, self.out, self.rank, nodes, self.device, self.resumed)
        if not self.resumed:
            self.mllog.cache_clear(os.environ.get(CACHE_CLEARED_ENV) == "1")
            self.mllog.init_start()
            reporting.log_hyperparameters(self.mllog, self.cfg, self.state.seed, self.micro_batch)

    def _build_model(self) -> None:
        """The model on its device, sharded (optim.shard), wrapped for the steps; static shapes' buckets and graphs."""
        cfg, t = self.cfg, self.cfg.train
        if t.flat_host_memory:
            map_large_allocations()
        self.model_config = build_model_config(cfg)
        torch.manual_seed(self.state.seed)  # same initial weights on every rank
        self.philox = philox_state(self.device)  # the kernels' dropout state: seeded each step, advanced on the device
        self.context_pool = None
        if cfg.dist.context_size > 1:
            with self.coll.guard("the context-parallel groups' setup", -1):
                try:
                    self.context_pool = ContextPool(*cfg.dist.context_parallel, cfg.dist.timeout_s)
                except ValueError as e:
                    raise ConfigError(str(e)) from None
        context = self.context_pool.groups if self.context_pool else None
        self.model = components.build_model(cfg.model, self.model_config, t, self.device, context)
        if cfg.checkpoint.init:
            load_pretrained(self.model, cfg.checkpoint.init)
        self.model.to(self.device)
        with self.coll.guard("the shard groups' setup", -1):
            self.sharding = apply_sharding(self.model, cfg.optim, t.precision, self.world, self.device.type)
        # forward: the model as the steps call it (DDP over ranks, torch.compile'd if asked).
        self.ddp, self.forward = components.build_forward(
            self.model, cfg.model, self.device, self.coll, self.sharding is not None
        )
        self.static, self.model.encoder_graphs = components.build_graphs(cfg, self.micro_batch, self.model)
        self.autocast_dtype = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[t.precision]

    def _build_rebalancer(self):
        """data.rebalance's exchange; ``measured`` plans from this rank's forward+backward times."""
        with self.coll.guard("the rebalancer's settings check", -1):
            rebalancer = components.build_rebalancer(self.cfg, self.local_batch, self.cfg.dist.timeout_s)
        if self.cfg.data.rebalance == "measured":
            rebalancer.timer = StepTimer(self.model, self.device)
        return rebalancer

    def _resume(self, found) -> dict:
        """The newest good checkpoint's parts and counters restored; returns the loader position."""
        restored, loader_state = resume(found, self.checkpoint_dir, self.parts, self.progress.message)
        restored.seed = self.state.seed  # the newest checkpoint's (resolve_seed); an older one's is the same
        self.state = restored
        return loader_state

    def _warn(self, message: str) -> None:
        """A warning every rank may have (a corrupt shard is found by the rank that reads it)."""
        print(f"warning (rank {self.rank}): {message}" if self.world > 1 else f"warning: {message}", flush=True)

    def _autocast(self):
        if self.autocast_dtype is None:
            return contextlib.nullcontext()
        # CUDA graphs replay kernels, so autocast must not cache casts of the weights.
        return torch.autocast(self.device.type, dtype=self.autocast_dtype, cache_enabled=not self.cfg.train.cuda_graphs)

    def _collate(self, block: SampleBlock):
        """SampleBlock -> the configured batch layout, by the configured backend (torch, dali)."""
        if self._collator is None:
            # data.rebalance=measured: a rank's micro-batch may hold up to max_share times its share
            share = self.cfg.data.rebalance_measured[3] if self.cfg.data.rebalance == "measured" else 1.0
            most = max(math.ceil(self.micro_batch * share), self.cfg.eval.batch_size)
            self._collator = components.build_collator(self.cfg.data, self.device, most)
        return self._collator(block)

    def _micro_batch(self, block: SampleBlock, record: bool = True):
        """(``block`` collated, padded to its bucket under train.static_shapes, on the device;
        its real (tokens, sequences, masked) counts, from the host). ``record``: note its shape."""
        if self.context_pool is not None:  # this rank's short samples and its pieces of the group's long ones
            batch = self.context_pool(block, self._collate)
            real = (batch.batch.num_tokens, len(block), int(block.masked_counts.sum()))
            return to_device(batch, self.device), real
        batch = self._collate(block)
        real = (batch.num_tokens, len(block), int(block.masked_counts.sum()))
        batch = self.static.pad(batch) if self.static else batch
        if record:
            self.shapes_seen.add((batch.num_tokens, batch.mlm_positions.numel()))
        return to_device(batch, self.device), real

    # ---- the named steps -----------------------------------------------------------------

    def train_step(self, block: SampleBlock) -> StepResult:
        """Forward and backward over this rank's micro-batches of one global batch."""
        seed_step(self.state.seed, self.state.step, self.rank, self.philox)  # torch's and the kernels' dropout
        # The global counts the losses are normalised by, and any rank's stop request, agreed
        # on the host from the data (bert.distributed.host_counts): nothing is read from the device.
        step = self.state.step
        c = self.planner.agree(step, self.stop_requested)
        self.stop_agreed = c.stop
        # DDP all-reduces (FSDP2 reduce-scatters) the gradients inside the last micro-batch's backward.
        what = "the gradient " + ("reduce-scatter (FSDP2 backward)" if self.sharding else "all-reduce (DDP backward)")
        with self.coll.guard(what, step + 1), philox_from(self.philox):
            loss_parts = self.forward_backward(block, c.masked, c.sequences, c.anchors)
        return StepResult(loss_parts, c.sequences, c.tokens, c.corrupt)

    def forward_backward(
        self, block: SampleBlock, num_masked: int, num_seqs: int, num_anchors: int, replicas: int | None = None
    ) -> torch.Tensor:
        """This rank's micro-batches through forward and backward; returns the [4] loss parts.
        ``replicas``: dist.fault_tolerance's live replicas, whose shares of the batch may differ in size."""
        loss_cfg = self.cfg.loss
        self.forward.train()
        loss_parts = torch.zeros(4, device=self.device)
        # DDP, FSDP2 and torchft average gradients over ranks (replicas); the losses are sums.
        scale = float(replicas or self.world)
        if replicas is None:
            # train.grad_accum_steps micro-batches (fewer in a batch-size warm-up), as many on every rank: from
            # the step's agreed count, since data.rebalance=measured leaves a slow rank fewer samples than a fast one.
            n = num_seqs // self.world // self.micro_batch
            ends = len(block) * np.arange(n + 1) // n  # equal blocks: micro_batch each
            chunks = [np.arange(ends[i], ends[i + 1]) for i in range(n)]
        else:
            chunks = [c for c in np.array_split(np.arange(len(block)), self.cfg.train.grad_accum_steps) if len(c)]
        last = len(chunks) - 1
        for i, rows in enumerate(chunks):
            mb = block.select(rows)
            # Padded to its bucket (train.static_shapes); real: the sizes without the padding.
            batch, real = self._micro_batch(mb)
            sync = self.ddp is None or i == last
            if self.sharding:  # FSDP2 accumulates unsharded gradients until the last micro-batch
                self.model.set_requires_gradient_sync(i == last)
            with contextlib.nullcontext() if sync else self.ddp.no_sync(), self._autocast():
                out = self.forward(batch)
                loss, stats = pretraining_loss(
                    out.mlm_logits, batch.mlm_labels, out.nsp_logits, batch.nsp_labels, num_masked, num_seqs
                )
                simreg_part = torch.zeros((), device=self.device)
                if loss_cfg.simreg_weight > 0:
                    args = (loss_cfg.simreg_temperature, loss_cfg.simreg_scope, real if self.static else None)
                    simreg_part = simreg_term(out.hidden_states, batch, mb, *args) / max(num_anchors, 1)
                    loss = loss + loss_cfg.simreg_weight * simreg_part
            backward_loss = loss * scale
            (self.scaler.scale(backward_loss) if self.scaler else backward_loss).backward()
            mlm, nsp = stats["mlm_loss_sum"] / max(num_masked, 1), stats["nsp_loss_sum"] / max(num_seqs, 1)
            loss_parts += torch.stack([loss.detach(), mlm, nsp, simreg_part.detach()])
        return loss_parts

    def replica_step(self):
        """dist.fault_tolerance: one try at the step (StepResult, rebalance stats), or (None, None) when the quorum
        did not commit it (a replica was lost): the caller tries again on the same samples."""
        quorum = self.ft.begin_step(self.state.step)
        step, self.ft_rank = self.state.step, quorum.rank  # a healed replica is at the others' step now
        if quorum.changed:
            self._quorum_changed(quorum)
        block = self.planner.block(step)
        seed_step(self.state.seed, step, quorum.rank, self.philox)
        c = self.planner.counts(step, self.stop_requested)
        self.stop_agreed = c.stop
        share, rebalance = self.planner.share(block, step, quorum)
        with philox_from(self.philox):
            loss_parts = self.forward_backward(share, c.masked, c.sequences, c.anchors, replicas=quorum.size)
        # The loss parts travel with the gradients: averaged, times the replicas, they are the sums.
        loss_parts *= quorum.size
        self.ft.average_([p.grad for p in self.model.parameters() if p.grad is not None] + [loss_parts])
        if not self.ft.commit():
            self.optimizer.zero_grad(set_to_none=True)
            self.progress.message(
                f"warning: replica {self.ft.replica}: step {step + 1} was not committed by the quorum "
                f"of {quorum.size} (a replica was lost or stopped); redoing it on the same samples"
            )
            return None, None
        return StepResult(loss_parts, c.sequences, c.tokens, c.corrupt), rebalance

    def _quorum_changed(self, quorum: Quorum) -> None:
        """One line per change of quorum, in the progress output, metrics.jsonl and mlperf.log."""
        s = self.state
        self.progress.message(
            f"quorum {quorum.quorum_id}: step {s.step + 1}: {quorum.size} replica(s), replica "
            f"{self.ft.replica} is rank {quorum.rank} ({quorum.seconds * 1e3:.0f} ms)"
        )
        rec = {"step": s.step, "samples": s.samples, "replicas": quorum.size, "replica_rank": quorum.rank}
        self.metrics.write(rec | {"quorum_id": quorum.quorum_id, "quorum_ms": quorum.seconds * 1e3})
        self.mllog.quorum(s.samples, quorum.size, s.step)

    def _replica_state(self) -> dict:
        """What a healing replica receives from this one (torchft calls it between steps): a checkpoint's contents."""
        self._read_counters()
        loader = {**self.train_loader.state_dict(), "step": self.state.step}
        return to_checkpoint(self.state, self.parts, loader, self.cfg.to_dict())

    def _load_replica_state(self, saved: dict) -> None:
        """A peer's ``_replica_state`` into this replica's parts and counters (torchft heals with it)."""
        seed, self.state = self.state.seed, restore(saved, self.parts)
        self.state.seed = seed  # the run's, the same on every replica
        self.counters = DeviceCounters(self.device, self.state.skipped, self.state.nonfinite_in_row)
        self.progress.message(f"replica {self.ft.replica}: recovered from a peer at step {self.state.step}")

    def optimizer_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Clip, skip a non-finite update, step LAMB and the schedule, all decided on the device.
        Returns (applied, grad norm) as 0-dim device tensors (reading them syncs)."""
        # Sharded, the norms of the clipping and of LAMB's trust ratios are all-reduces.
        what = "the optimizer's norm all-reduce (optim.shard)"
        with self.coll.guard(what, self.state.step + 1) if self.sharding else contextlib.nullcontext():
            params = [p for p in self.model.parameters() if p.grad is not None]
            view = {"local": self.sharding.local, "norms": self.sharding.norms} if self.sharding else {}
            clip_stats = None  # AdaGC's, for the logs
            if self.scaler:
                self.scaler.unscale_(self.optimizer)
            inject_debug_faults(self.cfg.debug, self.model, self.state.step + 1)
            if self.adagc is not None:
                # AdaGC clips without the global norm; it is computed for the non-finite check and the logs.
                clip_stats = self.adagc.clip_(compute_global_norm=True)
                norm = clip_stats.global_norm
            elif self.cfg.optim.clip == "global":
                norm = clip_global_(params, self.cfg.optim.max_grad_norm, **view)
            else:
                local, norms = view.get("local", lambda g: g), view.get("norms", tensor_norms)
                norm = torch.linalg.vector_norm(norms([local(p.grad) for p in params]))
            # No update on non-finite gradients: the optimizer, schedule and AdaGC skip on the device
            # (bert.optim); fp16's GradScaler decides its own skip on the host (scaler.step reads).
            found_inf = ~torch.isfinite(norm)
            apply_update(self.optimizer, self.schedule, found_inf, self.scaler)
            if self.adagc is not None:
                # AdaGC kept its thresholds on the non-finite step but counted it; the skipped
                # step leaves all optimizer state as it was, its step count included.
                self.adagc.unstep_(found_inf)
            self.counters.update(found_inf, norm, clip_stats)
            self.optimizer.zero_grad(set_to_none=True)
            return ~found_inf, norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Masked-LM accuracy over the whole eval set (counts all-reduced over ranks)."""
        self.model.eval()
        counts = masked_lm_counts(self.model, self.eval_batches(self.eval_loader), self.device, self._autocast)
        correct, total = self.coll.all_reduce(counts, "the eval-accuracy all-reduce", self.state.step).tolist()
        if self.sharding:
            reshard(self.model)  # evaluation gathered the weights; only the shards stay
        return correct / max(total, 1)

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
            if self.ft is not None:
                self.ft.shutdown()

    def _on_sigterm(self, signum, frame) -> None:
        self.stop_requested = True

    def _log_start(self) -> None:
        """A fresh run: warm up, end initialisation, start the clock. Then open the data."""
        if not self.resumed:
            self.warm_up()
            if self.cfg.eval.at_start:
                self.evaluate_at_start()
            self.mllog.init_stop()
            self.mllog.run_start()
        self._clock_started = time.time()  # the summary's time to train counts from here, as MLPerf's
        self._open_data()
        if self.resumed:
            self.progress.message(f"resumed from step {self.state.step} ({self.state.samples} samples)")
        self.mllog.epoch_start(self.state.samples)  # 0 for a fresh run

    def warm_up(self) -> None:
        """Forward and backward on synthetic batches before the clock, so compilation, autotuning and the
        allocator's first growth are not timed; no optimizer step, gradients dropped, RNG states restored."""
        cuda = self.device.type == "cuda"
        blocks = components.build_warm_up_blocks(self.cfg.data, self.model_config.vocab_size, self.micro_batch, cuda)
        self.forward.train()
        with torch.random.fork_rng([self.device] if cuda else [], device_type="cuda"):  # restored on the way out
            for block in blocks:  # padded as training pads (train.cuda_graphs captures their shapes)
                batch, (_, seqs, masked) = self._micro_batch(block, record=False)
                with self._autocast(), philox_from(self.philox):  # a graph captured here reads the device state
                    out = self.forward(batch)
                    loss, _ = pretraining_loss(
                        out.mlm_logits, batch.mlm_labels, out.nsp_logits, batch.nsp_labels, masked, seqs
                    )
                with self.coll.guard("the warm-up's gradient all-reduce", 0):
                    loss.backward()
            self.optimizer.zero_grad(set_to_none=True)
            self.model.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(self.device)

    def evaluate_at_start(self) -> None:
        """eval.at_start: the initial weights' accuracy, before the clock (open division only)."""
        self.eval_loader = components.build_eval_loader(self.cfg, self.rank, self.world, self.model_config.vocab_size)
        acc = self.evaluate()
        self.metrics.write({"step": 0, "samples": 0, "eval_at_start_accuracy": acc})
        self.progress.message(f"eval at start (initial weights, not timed)  masked-LM accuracy {acc:.4f}")

    def _open_data(self) -> None:
        """The loaders: the first reads of the dataset, after run_start."""
        self.train_loader, self.eval_loader = components.build_loaders(  # eval.at_start may have opened eval's
            self.cfg, self.rank, self.world, self.state.seed, self.model_config, self._warn, self.eval_loader
        )
        if self._loader_state is not None:
            self.train_loader.load_state_dict(self._loader_state)
            if self.rebalancer:  # data.rebalance=measured's window: what the next plans depend on
                self.rebalancer.load_state_dict(self._loader_state)

    def _train(self) -> dict:
        cfg, t = self.cfg, self.cfg.train
        self._log_start()
        run_start = self._clock_started - self.state.train_seconds
        # NVIDIA's v4.0 numbering: one block over the whole run, first_epoch_num 1 and
        # epoch_count 1; evaluations inside it carry the samples trained as epoch_num.
        self.mllog.block_start(self.state.samples if self.resumed else 1, 1)
        self._window = [time.time(), 0, 0]  # since the last metrics record: start, samples, tokens
        scope = cfg.loss.simreg_scope if cfg.loss.simreg_weight > 0 else None  # SimReg's anchors counted on the host
        if self.ft is not None:  # every replica reads the whole global batch (bert.distributed.fault_tolerance)
            d = cfg.data
            cost = tuple(d.rebalance_cost)
            self.planner = ReplicaPlanner(self.train_loader, d.rebalance, cost, d.rebalance_group_size, scope)
        else:
            self.planner = StepPlanner(self.train_loader, self.rebalancer, self.agreement, self.coll, scope)
            self.planner.begin(self.state.step)
        status, retried_since = None, None
        while status is None:
            step_start = retried_since or time.time()
            if self.ft is not None:
                result, rebalance = self.replica_step()
                if result is None:  # the failed try's time is the step's too
                    retried_since = step_start
                    continue
                retried_since = None
            else:
                block, rebalance = self.planner.next_block(self.state.step)
                step_start = time.time()
                result = self.train_step(block)
            self.optimizer_step()
            self._count(result, time.time() - step_start)
            if self.state.step % t.log_interval_steps == 0 or self.state.step == 1:
                # The one read of the device in a logged step; non-finite runs are seen here.
                self._log_step(result, rebalance)
                status = reporting.nonfinite_abort(self.progress, self.state, t.max_nonfinite_steps)
            status = self._evaluate_if_due(status)
            ckpt_due = cfg.checkpoint.interval_steps and self.state.step % cfg.checkpoint.interval_steps == 0
            if status is None and (ckpt_due or self.stop_agreed):
                saved = self.save_checkpoint()
                if self.stop_agreed:  # SIGTERM: the run ends as interrupted, its checkpoint written or not
                    self.planner.drain()  # the exchange started for a step that will not run
                    self.mllog.close()
                    return reporting.interrupted(self.state, saved, self.error, self.progress)
                if not saved and cfg.checkpoint.on_error == "stop":
                    status = "aborted"
        time_to_train = time.time() - run_start
        if cfg.checkpoint.at_end:
            self.save_checkpoint()
        return self._finish(status, time_to_train)

    def _count(self, result: StepResult, seconds: float) -> None:
        s = self.state
        s.step += 1
        s.samples += result.samples
        s.tokens += result.tokens
        if result.corrupt:
            s.corrupt_samples += result.corrupt
            self.progress.message(
                f"warning: step {s.step}: {result.corrupt} corrupt sample(s) replaced by the "
                f"next valid ones (data.on_corrupt=skip); {s.corrupt_samples} so far"
            )
        s.train_seconds += seconds
        self._window[1] += result.samples
        self._window[2] += result.tokens

    def _read_counters(self, **extra: torch.Tensor) -> dict:
        """One device read: the skipped-step counters into the state, and ``extra``."""
        got = self.counters.read(**extra)
        self.state.skipped, self.state.nonfinite_in_row = got["skipped"], got["in_row"]
        return got

    def _log_step(self, result: StepResult, rebalance) -> None:
        """A metrics record and a progress line (every train.log_interval_steps, and step 1)."""
        parts = self.coll.all_reduce(result.loss_parts.clone(), "the loss all-reduce", self.state.step)
        got = self._read_counters(parts=parts, lr=self.schedule.applied_lr())
        start, samples, tokens = self._window
        elapsed = max(time.time() - start, 1e-9)
        rec = reporting.step_record(self.cfg, self.state, got, (samples / elapsed, tokens / elapsed), rebalance)
        self.metrics.write(rec)
        self.progress.step(rec)
        self._window = [time.time(), 0, 0]

    def _evaluate_if_due(self, status: str | None) -> str | None:
        """Evaluate every eval interval and at the run's limits; the status that follows."""
        s, t = self.state, self.cfg.train
        crossed = s.samples // self.eval_interval > s.last_eval_samples // self.eval_interval
        at_limit = s.step >= t.max_steps or s.samples >= t.max_samples
        if crossed or (at_limit and s.last_eval_samples != s.samples):
            self.mllog.eval_start(s.samples)
            s.eval_accuracy, s.last_eval_samples = self.evaluate(), s.samples
            self.mllog.eval_accuracy(s.samples, s.eval_accuracy)
            self.mllog.eval_stop(s.samples)
            reporting.report_eval(self.metrics, self.progress, s, self.cfg.eval.target_accuracy)
            if s.eval_accuracy >= self.cfg.eval.target_accuracy:
                return "success"
        return "aborted" if status is None and at_limit else status

    def _finish(self, status: str, time_to_train: float) -> dict:
        self.planner.drain()
        self._read_counters()
        reporting.log_run_stop(self.mllog, self.state.samples, self.eval_loader.total_samples, status)
        summary = reporting.summary(self.state, status, time_to_train, self.world, self.metrics.records, self.error)
        summary["distinct_shapes"] = len(self.shapes_seen)
        if self.ft is not None:  # the quorums' host time, apart from the steps' (it is inside train_seconds)
            summary.update(quorums=self.ft.quorums, quorum_seconds=self.ft.quorum_seconds)
        if self.is_main:
            reporting.publish_summary(summary, self.out, self.metrics, self.progress, self.cfg.log.plot)
        return summary

    # ---- checkpoints ---------------------------------------------------------------------

    def save_checkpoint(self) -> bool:
        """Rank 0 writes the checkpoint (dist.fault_tolerance: the last quorum's rank 0); every rank gets whether it
        worked (a failure is reported; the caller goes on or stops by checkpoint.on_error)."""
        if self.ft is not None and self.ft_rank != 0:
            return True
        self._read_counters()  # the skipped-step counters live on the device
        # The rebalancer has already drawn the next step's samples from the loader: the
        # position to resume at is the number of steps trained.
        rebalance = self.rebalancer.state_dict() if self.rebalancer else {}
        loader = {**self.train_loader.state_dict(), "step": self.state.step, **rebalance}
        error = write_checkpoint(self.checkpoint_dir, self.state, self.parts, loader, self.cfg, self.coll)
        failed = self.coll.all_reduce(
            torch.tensor([int(error is not None)], device=self.device), "the checkpoint commit", self.state.step
        )
        if not int(failed):
            return True
        self.state.checkpoint_failures += 1
        if self.is_main:
            reporting.checkpoint_failed(self.progress, self.state.step, error, self.checkpoint_dir, self.cfg.checkpoint)
        if self.cfg.checkpoint.on_error == "stop" or self.stop_agreed:
            detail = f": {error}" if error else ""
            self.error = f"the checkpoint of step {self.state.step} could not be written{detail}"
        return False
