"""Sharded LAMB (``optim.shard``) against the unsharded optimizer, side by side on the same ranks.

    python bench/optimizer.py [--preset base] [--ranks 4] [--step-ranks 2] [--steps 5] [--json PATH]
    python bench/optimizer.py --device cuda --ranks 1 --step-ranks 1 --preset large --precision bf16

The first form runs gloo CPU ranks (the issue's CPU goals); the second one GPU, NCCL, the
sharded path at group size 1 against the unsharded one (bench/gpu_check.sh's ``optimizer``
stage), and its per-tensor update time feeds the estimate in docs/sharding.md.

Three measurements, each one torchrun launch of this script (``--worker``) that runs the
unsharded and the sharded variant one after the other on the same ranks:

- ``optimizer``: ``--ranks`` ranks, the preset's shapes (BERT-base by default), random
  gradients: the median time per rank of the optimizer step (global-norm clipping + LAMB),
  DDP-style (every rank updates every tensor) against ``ShardedLamb`` on 1/G of each tensor,
  and the optimizer-state bytes per rank.
- ``clipping``: the same ranks: the time of the norms' all-reduce that global clipping and
  AdaGC need on shards (a [1] vector for the global norm, [N] per-tensor norms for AdaGC).
- ``step``: ``--step-ranks`` ranks, the whole training step (forward, backward with the
  gradient reduction, clipping, LAMB) of the same model on a small batch, DDP against FSDP2.

It prints every ratio next to the issue's goal (optimizer step <= 0.35x, state <= 0.26x at 4
ranks; whole step <= 1.02x at 2 ranks). Ranks share the machine's cores, so the unsharded
variant's G copies of the update compete for them as they would for a node's memory bandwidth.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

GOALS = {"optimizer_step": 0.35, "state_bytes": 0.26, "whole_step": 1.02}  # the issue's, at 4 and 2 CPU ranks
# One rank (one GPU: a group of 1): the sharded path must be no slower than the unsharded one.
GOALS_ONE_RANK = {"optimizer_step": 1.0, "state_bytes": 1.0, "whole_step": 1.0}
DEVICE, PRECISION = "cpu", "fp32"  # --device, --precision (set in main, for the workers)


def _device() -> torch.device:
    if torch.cuda.is_available() and DEVICE == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def _sync() -> None:
    if _device().type == "cuda":
        torch.cuda.synchronize()


def _model(preset: str, vocab: int):
    from bert.model.config import BertConfig
    from bert.model.pretraining import BertForPreTraining

    torch.manual_seed(0)
    config = BertConfig.preset(preset, vocab_size=vocab, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return BertForPreTraining(config, attention="padded").to(_device())


def _engine(model, sharded: bool):
    """(optimizer, local, norms, forward) for the unsharded (DDP) or sharded (FSDP2, one group) variant."""
    from bert.config import OptimSection
    from bert.optim.optimizers import build_optimizer
    from bert.optim.shard import WholeNorms, apply_sharding, build_sharded_lamb, local_shard

    optim = OptimSection(lr=1e-3, shard="dp" if sharded else "none")
    device = _device()
    sharding = apply_sharding(model, optim, PRECISION, dist.get_world_size(), device.type)
    if sharding is None:
        ids = [device.index] if device.type == "cuda" else None
        forward = (
            torch.nn.parallel.DistributedDataParallel(model, device_ids=ids) if dist.get_world_size() > 1 else model
        )
        return build_optimizer(optim, model, impl="torch"), local_shard, WholeNorms(None), forward
    return build_sharded_lamb(optim, model, sharding), sharding.local, sharding.norms, model


def _median_ms(times: list[float]) -> float:
    return 1000 * statistics.median(times)


def worker_optimizer(args) -> dict:
    from bert.optim.clipping import clip_global_
    from bert.optim.shard import optimizer_state_bytes

    out = {}
    for name, sharded in (("unsharded", False), ("sharded", True)):
        model = _model(args.preset, args.vocab)
        optimizer, local, norms, _ = _engine(model, sharded)
        params = list(model.parameters())
        gen = torch.Generator().manual_seed(1)
        times = []
        for _ in range(args.warmup + args.steps):
            for p in params:  # random gradients, the same on every rank (as after a reduction)
                g = local(p)
                grad = (torch.randn(g.shape, generator=gen) * 1e-3).to(g.device)
                if sharded:
                    from torch.distributed.tensor import DTensor

                    p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, shape=p.shape, stride=p.stride())
                else:
                    p.grad = grad
            _sync()
            dist.barrier()
            start = time.perf_counter()
            clip_global_(params, 1.0, local=local, norms=norms)
            optimizer.step()
            _sync()
            times.append(time.perf_counter() - start)
        per_rank = [None] * dist.get_world_size()
        dist.all_gather_object(per_rank, (_median_ms(times[args.warmup :]), optimizer_state_bytes(optimizer)))
        out[name] = {"step_ms": [t for t, _ in per_rank], "state_bytes": [b for _, b in per_rank]}
        out["tensors"] = len(params)
        del model, optimizer, params
    return out


def worker_clipping(args) -> dict:
    n = sum(1 for _ in _model(args.preset, args.vocab).parameters())
    out = {"tensors": n}
    for name, size in (("global_norm", 1), ("adagc_norms", n), ("lamb_trust_norms", 2 * n)):
        buf = torch.ones(size, device=_device())
        times = []
        for _ in range(args.warmup + 20 * args.steps):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(buf)
            _sync()
            times.append(time.perf_counter() - start)
        medians = [None] * dist.get_world_size()
        dist.all_gather_object(medians, _median_ms(times[args.warmup :]))
        out[name] = {"bytes": 4 * size, "all_reduce_ms": max(medians)}
    return out


def worker_step(args) -> dict:
    from bert.optim.clipping import clip_global_
    from bert.train.losses import pretraining_loss
    from data.loader import make_collator
    from data.synthetic import random_block

    rank, world = dist.get_rank(), dist.get_world_size()
    collate = make_collator("torch", "unpadded", args.seq)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(PRECISION)
    autocast = torch.autocast(_device().type, dtype=dtype) if dtype else contextlib.nullcontext()
    out = {}
    for name, sharded in (("unsharded", False), ("sharded", True)):
        model = _model(args.preset, args.vocab)
        optimizer, local, norms, forward = _engine(model, sharded)
        params = list(model.parameters())
        times = []
        for step in range(args.warmup + args.steps):
            block = random_block(args.batch * world, seed=step, max_seq_length=args.seq, vocab_size=args.vocab)
            mine = collate(block.select(np.arange(rank * args.batch, (rank + 1) * args.batch))).to(_device())
            _sync()
            dist.barrier()
            start = time.perf_counter()
            with autocast:
                out_ = forward(mine)
            loss, _ = pretraining_loss(
                out_.mlm_logits,
                mine.mlm_labels,
                out_.nsp_logits,
                mine.nsp_labels,
                int(block.masked_counts.sum()),
                len(block),
            )
            (loss * world).backward()
            clip_global_(params, 1.0, local=local, norms=norms)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            _sync()
            times.append(time.perf_counter() - start)
        medians = [None] * world
        dist.all_gather_object(medians, _median_ms(times[args.warmup :]))
        out[name] = {"step_ms": medians}
        numel = sum(local(p).numel() for p in params) * (world if sharded else 1)
        del model, optimizer, params, forward
    out["collectives"] = _gradient_collectives(numel, args.steps)
    return out


def _gradient_collectives(numel: int, reps: int) -> dict:
    """The backend's all-reduce of every gradient (DDP) against reduce-scatter + all-gather
    (FSDP2), alone, at fp32: what the whole-step ratio is made of besides the update."""
    world = dist.get_world_size()
    numel -= numel % world
    grads = torch.ones(numel, device=_device())
    shard, gathered = torch.empty(numel // world, device=_device()), torch.empty(numel, device=_device())
    out = {"megabytes": 4 * numel / 1e6}
    for name, run in (
        ("all_reduce_ms", lambda: dist.all_reduce(grads)),
        ("reduce_scatter_ms", lambda: dist.reduce_scatter_tensor(shard, grads)),
        ("all_gather_ms", lambda: dist.all_gather_into_tensor(gathered, shard)),
    ):
        times = []
        for _ in range(reps):
            _sync()
            dist.barrier()
            start = time.perf_counter()
            run()
            _sync()
            times.append(time.perf_counter() - start)
        out[name] = _median_ms(times)
    return out


def _launch(parts: list[str], ranks: int, args) -> dict:
    """Run ``parts`` one after another in one launch of ``ranks`` ranks; {part: its result}."""
    part = ",".join(parts)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "result.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}", "--standalone"]
        cmd += [os.path.abspath(__file__), "--worker", part, "--out", path, "--preset", args.preset]
        cmd += ["--vocab", str(args.vocab), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        cmd += ["--seq", str(args.seq), "--batch", str(args.batch), "--device", args.device]
        cmd += ["--precision", args.precision, "--parts", args.parts]
        env = {
            **os.environ,
            "OMP_NUM_THREADS": str(args.threads),
            "PYTHONPATH": str(Path(__file__).resolve().parents[1]),
        }
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            tail = (proc.stdout + proc.stderr).strip().splitlines()[-15:]
            print(f"error: bench/optimizer.py: the {part} measurement on {ranks} ranks failed:\n" + "\n".join(tail))
            sys.exit(1)
        with open(path) as f:
            return json.load(f)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="base", help="model shapes (bert.config presets)")
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--ranks", type=int, default=4, help="ranks of the optimizer and clipping measurements")
    ap.add_argument("--step-ranks", type=int, default=2, help="ranks of the whole-step measurement")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq", type=int, default=128, help="longest sequence of the whole-step batch")
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank of the whole-step batch")
    ap.add_argument("--threads", type=int, default=1, help="OMP threads per rank")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="cuda: one GPU per rank, NCCL")
    ap.add_argument("--precision", default="fp32", choices=("fp32", "bf16"), help="compute dtype of the whole step")
    ap.add_argument("--parts", default="optimizer,clipping,step", help="measurements to run (comma-separated)")
    ap.add_argument("--json", help="also write the results here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for name in ("ranks", "step_ranks", "steps", "seq", "batch", "threads", "vocab"):
        if getattr(args, name) < 1:
            print(f"error: --{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
            return 2

    global DEVICE, PRECISION
    DEVICE, PRECISION = args.device, args.precision
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda: CUDA is not available here")
        return 2
    if args.worker:
        torch.set_num_threads(args.threads)
        dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
        workers = {"optimizer": worker_optimizer, "clipping": worker_clipping, "step": worker_step}
        result = {part: workers[part](args) for part in args.worker.split(",")}
        if dist.get_rank() == 0:
            with open(args.out, "w") as f:
                json.dump(result, f)
        dist.barrier()  # every rank is done with its peers
        # No teardown (process group, interpreter), as run_pretraining.py skips the
        # interpreter's: gloo sometimes aborts in it ("terminate called without an active
        # exception") after the results are written.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)

    parts = args.parts.split(",")
    if set(parts) - {"optimizer", "clipping", "step"} or "optimizer" not in parts or "step" not in parts:
        print(f"error: --parts: optimizer and step, and optionally clipping; got {args.parts!r}")
        return 2
    # Starting ranks costs seconds: parts on the same number of ranks share one launch.
    on_ranks = ["optimizer"] + (["clipping"] if "clipping" in parts else [])
    if args.step_ranks == args.ranks:
        results = _launch([*on_ranks, "step"], args.ranks, args)
    else:
        results = {**_launch(on_ranks, args.ranks, args), **_launch(["step"], args.step_ranks, args)}
    opt, clip, step = results["optimizer"], results.get("clipping"), results["step"]
    r_step = statistics.median(opt["sharded"]["step_ms"]) / statistics.median(opt["unsharded"]["step_ms"])
    r_state = max(opt["sharded"]["state_bytes"]) / max(opt["unsharded"]["state_bytes"])
    r_whole = statistics.median(step["sharded"]["step_ms"]) / statistics.median(step["unsharded"]["step_ms"])
    goals = GOALS_ONE_RANK if args.ranks == 1 and args.step_ranks == 1 else GOALS
    rows = [
        (
            f"optimizer step per rank, {args.ranks} ranks",
            opt["unsharded"]["step_ms"],
            opt["sharded"]["step_ms"],
            r_step,
            "optimizer_step",
        ),
        (
            f"optimizer state per rank (MB), {args.ranks} ranks",
            [b / 1e6 for b in opt["unsharded"]["state_bytes"]],
            [b / 1e6 for b in opt["sharded"]["state_bytes"]],
            r_state,
            "state_bytes",
        ),
        (
            f"whole step, {args.step_ranks} ranks",
            step["unsharded"]["step_ms"],
            step["sharded"]["step_ms"],
            r_whole,
            "whole_step",
        ),
    ]
    shapes = f"{args.preset} shapes (vocab {args.vocab})"
    where = "NCCL, one GPU per rank" if args.device == "cuda" else f"gloo CPU ranks, {args.threads} thread(s) each"
    print(f"sharded LAMB vs unsharded, {shapes}, {where}")
    print(f"{'measure':44s} {'unsharded':>12s} {'sharded':>12s} {'ratio':>7s} {'goal':>7s}")
    for label, a, b, ratio, goal in rows:
        ok = "met" if ratio <= goals[goal] else "MISSED"
        goal_text = f"<={goals[goal]}"
        a, b = statistics.median(a), statistics.median(b)
        print(f"{label:44s} {a:12.1f} {b:12.1f} {ratio:7.3f} {goal_text:>7s} {ok}")
    per_tensor = statistics.median(opt["unsharded"]["step_ms"]) / opt["tensors"]
    print(f"unsharded update time per tensor (mean over {opt['tensors']} tensors): {1000 * per_tensor:.1f} us")
    c = step["collectives"]
    print(
        f"gradient collectives alone, {args.step_ranks} ranks, {c['megabytes']:.0f} MB fp32: all-reduce "
        f"{c['all_reduce_ms']:.0f} ms; reduce-scatter {c['reduce_scatter_ms']:.0f} ms + all-gather "
        f"{c['all_gather_ms']:.0f} ms = {(c['reduce_scatter_ms'] + c['all_gather_ms']) / c['all_reduce_ms']:.2f}x"
    )
    if clip:
        print(f"norm all-reduces on the shards, {args.ranks} ranks ({clip['tensors']} tensors):")
    for name in ("global_norm", "adagc_norms", "lamb_trust_norms") if clip else ():
        c = clip[name]
        print(f"  {name:18s} {c['bytes']:7d} bytes  {c['all_reduce_ms']:.3f} ms")
    result = {
        "args": vars(args),
        "optimizer": opt,
        "clipping": clip,
        "step": step,
        "ratios": {"optimizer_step": r_step, "state_bytes": r_state, "whole_step": r_whole},
        "goals": goals,
    }
    if args.json:
        from common.files import write_text

        write_text(args.json, json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
