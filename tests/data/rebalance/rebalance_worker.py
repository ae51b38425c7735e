"""Multi-process check of data.rebalance.exchange.Rebalancer; launched by tests/data/rebalance/test_exchange_dist.py.

Run under torchrun or mpirun (``launch.distributed.init_distributed`` reads either). Every
rank can rebuild every rank's input block from the seed, so each rank checks its output
against the plan computed in one process, and all outputs together against all inputs (the
global batch is the same set of samples).
Prints "REBALANCE-OK rank R" at the end, and rank 0 prints one "HIDDEN {json}" line with
the overlap measurements. Any failed check raises: non-zero exit.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np
import torch
import torch.distributed as dist

from data.rebalance.exchange import RebalanceError, Rebalancer
from data.rebalance.plan import assign
from data.samples import SampleBlock

B = 12  # samples per rank per step
MAX_LEN = 512
SEED = 1234  # every block below is a function of (SEED, step, rank)


def random_block(step: int, rank: int, batch: int = B, seed: int = SEED) -> SampleBlock:
    """A valid block with skewed lengths (some ranks much heavier than others)."""
    rng = np.random.default_rng([seed, step, rank])
    heavy = rank % 3 == 0  # makes the imbalance large, so ``balanced`` has to move samples
    L = np.where(rng.random(batch) < (0.6 if heavy else 0.15), MAX_LEN, rng.integers(1, MAX_LEN, batch)).astype(
        np.int32
    )
    m = np.minimum(L - 1, np.maximum(1, np.rint(0.15 * L))).astype(np.int32)
    m[L == 1] = 0
    pos = [
        np.sort(rng.choice(np.arange(1, n), size=k, replace=False)) if k else np.zeros(0, np.int64)
        for n, k in zip(L, m)
    ]
    return SampleBlock(
        input_ids=rng.integers(0, 30522, int(L.sum())).astype(np.int32),
        segment_ids=rng.integers(0, 2, int(L.sum())).astype(np.int8),
        seq_lens=L,
        masked_positions=np.concatenate(pos).astype(np.int32),
        masked_ids=rng.integers(0, 30522, int(m.sum())).astype(np.int32),
        masked_counts=m,
        nsp_labels=rng.integers(0, 2, batch).astype(np.int8),
    )


def sample_keys(block: SampleBlock) -> list[bytes]:
    """One byte string per sample holding everything in it, to compare sets of samples."""
    tok = np.concatenate([[0], np.cumsum(block.seq_lens)])
    msk = np.concatenate([[0], np.cumsum(block.masked_counts)])
    return [
        b"|".join(
            [
                block.input_ids[tok[i] : tok[i + 1]].tobytes(),
                block.segment_ids[tok[i] : tok[i + 1]].tobytes(),
                block.masked_positions[msk[i] : msk[i + 1]].tobytes(),
                block.masked_ids[msk[i] : msk[i + 1]].tobytes(),
                bytes([int(block.nsp_labels[i])]),
            ]
        )
        for i in range(len(block))
    ]


def init() -> tuple[int, int]:
    from launch.distributed import init_distributed  # here: the pure tests import this module too

    info = init_distributed(backend="gloo", timeout_s=60)  # torchrun or mpirun, from the environment
    return info.rank, info.world_size


def expect_error(fn, *needles: str) -> str:
    try:
        fn()
    except RebalanceError as e:
        msg = str(e)
        for n in needles:
            assert n in msg, f"error message {msg!r} lacks {n!r}"
        print(f"expected error on rank {dist.get_rank()}: {msg}", flush=True)
        return msg
    raise AssertionError(f"no RebalanceError (expected one mentioning {needles})")


def check_strategies(rank: int, world: int) -> None:
    configs = [("none", None), ("stripe", None), ("balanced", None), ("measured", None)]
    if world >= 4 and world % 2 == 0:
        configs.append(("balanced", 2))  # hierarchical: each rank plans only its group's part
    for strategy, group_size in configs:
        rb = Rebalancer(strategy, batch_size=B, max_len=MAX_LEN, timeout_s=30, group_size=group_size)
        for step in range(3):
            blocks = [random_block(step, r) for r in range(world)]
            out, stats = rb.exchange(blocks[rank])
            assert stats.step == step, (stats.step, step)
            # measured without a timer: equal speeds, the balanced plan
            plan = assign([b.seq_lens for b in blocks], strategy.replace("measured", "balanced"), group_size=group_size)
            expected = SampleBlock.concat(
                [blocks[s].select([i]) for s, i in zip(plan.src_rank[rank], plan.src_index[rank])]
            )
            where = f"{strategy} group_size={group_size} step {step}"
            assert len(out) == B and out.equals(expected), f"{where}: output differs from the plan"
            assert stats.samples_moved == (None if group_size else plan.moved), where
            if strategy == "none":
                assert out.equals(blocks[rank]) and stats.samples_moved == 0 and stats.payload_bytes_sent == 0
            if strategy in ("balanced", "measured"):
                assert plan.imbalance_after < plan.imbalance_before and plan.moved > 0, where
            # all outputs together hold exactly the inputs (the global batch is unchanged)
            outs = [None] * world
            dist.all_gather_object(outs, out)
            union_after = sorted(k for o in outs for k in sample_keys(o))
            assert union_after == sorted(k for b in blocks for k in sample_keys(b)), f"{where}: the union changed"
            assert sum(o.num_tokens for o in outs) == sum(b.num_tokens for b in blocks)


def check_ramp(rank: int, world: int) -> None:
    """A batch-size warm-up: each step's exchange holds that step's size (ramp.batch_size(s) / W
    per rank), the union of the outputs is the union of the inputs, and a rank that brings the
    full batch during the ramp is named on every rank."""
    from data.batch_ramp import BatchRamp

    ramp = BatchRamp(unit=2 * world, start=1, full=3, steps=4)  # 2, 2, 4, 4, then 6 samples per rank
    rb = Rebalancer("balanced", batch_size=6, max_len=MAX_LEN, timeout_s=30, ramp=ramp)
    for step in range(6):
        b = ramp.batch_size(step) // world
        blocks = [random_block(step, r, batch=b) for r in range(world)]
        out, stats = rb.exchange(blocks[rank], step=step)
        assert len(out) == b and stats.step == step, (len(out), b, step)
        outs = [None] * world
        dist.all_gather_object(outs, out)
        assert sorted(k for o in outs for k in sample_keys(o)) == sorted(k for x in blocks for k in sample_keys(x))
    wrong = random_block(6, rank, batch=6 if rank == world - 1 else 2)
    expect_error(lambda: rb.exchange(wrong, step=1), f"rank {world - 1}: holds 6 samples, expected batch_size 2")


def check_overlap(rank: int, world: int) -> dict:
    """start(step i+1) / compute step i / wait(): results match a synchronous exchange."""
    torch.manual_seed(SEED + rank)
    torch.set_num_threads(1)
    x = torch.randn(256, 256)
    rb = Rebalancer("balanced", batch_size=B, max_len=MAX_LEN, timeout_s=30)
    hidden, exchange_ms, wait_ms = [], [], []
    steps = 5
    for step in range(steps):
        block = random_block(100 + step, rank)
        rb.start(block, step=100 + step)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.15:  # the "training step" this exchange hides behind
            x = torch.tanh(x @ x * 1e-2)
        out, stats = rb.wait()
        plan = assign([random_block(100 + step, r).seq_lens for r in range(world)], "balanced")
        assert len(out) == B and stats.samples_moved == plan.moved
        hidden.append(stats.hidden_fraction)
        exchange_ms.append(stats.exchange_ms)
        wait_ms.append(stats.wait_ms)
    try:  # misuse is an error, not a hang
        rb.wait()
        raise AssertionError("wait() without start() did not raise")
    except RuntimeError:
        pass
    return dict(
        world_size=world,
        steps=steps,
        hidden_fraction_median=float(np.median(hidden)),
        exchange_ms_median=float(np.median(exchange_ms)),
        wait_ms_median=float(np.median(wait_ms)),
    )


class _Sleeper(torch.nn.Module):
    """A "model" whose forward sleeps in proportion to the tokens, ``slow`` times longer."""

    def __init__(self, slow: float):
        super().__init__()
        self.w, self.slow = torch.nn.Parameter(torch.ones(1)), slow

    def forward(self, tokens: int) -> torch.Tensor:
        # 5 us a token: 0.1 s a step here, so that a loaded 2-core machine's scheduling jitter (4 ranks
        # beside another pytest worker) stays well below the difference the fit must see.
        time.sleep(tokens * 5e-6 * self.slow)
        return self.w * tokens


def check_measured(rank: int, world: int) -> None:
    """measured, the last rank twice as slow (timed by bert.train.step_timer): it gets less work,
    and a rebalancer resumed from the state_dict plans the next step as the running one."""
    from bert.train.step_timer import StepTimer

    model = _Sleeper(2.0 if rank == world - 1 else 1.0)
    rb = Rebalancer("measured", batch_size=B, max_len=MAX_LEN, timeout_s=30, measured=(8, 4.0, 0.25))
    rb.timer = StepTimer(model, torch.device("cpu"))
    tokens, steps, speeds, cost = [], 20, rb.online.speeds, rb.online.cost
    rb.start(random_block(200, rank), step=0)
    for step in range(steps):
        out, stats = rb.wait()
        # the output is the single-process plan from the speeds it was planned with (ranks may hold
        # more or fewer than B samples: max_share 2)
        lengths = [random_block(200 + step, r).seq_lens for r in range(world)]
        plan = assign(lengths, "measured", cost, speeds=speeds, max_samples=2 * B)
        blocks = [random_block(200 + step, r) for r in range(world)]
        n = plan.counts[rank]
        pairs = zip(plan.src_rank[rank, :n], plan.src_index[rank, :n])
        assert out.equals(SampleBlock.concat([blocks[s].select([i]) for s, i in pairs])), f"measured step {step}"
        speeds, cost = rb.online.speeds, rb.online.cost  # what the next exchange, started now, plans with
        rb.start(random_block(201 + step, rank), step=step + 1)
        model(int(out.seq_lens.sum())).sum().backward()
        tokens.append(int(out.seq_lens.sum()))
    late = torch.tensor([float(sum(tokens[-6:]))])
    got = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(got, late)
    others = min(float(g) for g in got[:-1])
    # twice as slow: about half the tokens (the fit's cost is a + b*L per token, the sleep's a alone)
    share = float(got[-1]) / others
    print(f"measured: the slow rank's tokens / the others' {share:.3f}", flush=True)
    assert 0.35 < share < 0.7, f"the slow rank got {float(got[-1]):.0f} tokens, the others {others:.0f}"
    assert stats.fit["speed_min"] / stats.fit["speed_max"] < 0.6, stats.fit
    state = rb.state_dict()
    want, _ = rb.wait()
    resumed = Rebalancer("measured", batch_size=B, max_len=MAX_LEN, timeout_s=30, measured=(8, 4.0, 0.25))
    resumed.load_state_dict(state)
    again, _ = resumed.exchange(random_block(200 + steps, rank), step=steps)
    assert again.equals(want), "the resumed rebalancer planned another step"


def check_bad_input(rank: int, world: int) -> None:
    rb = Rebalancer("balanced", batch_size=B, max_len=MAX_LEN, timeout_s=30)
    last = world - 1
    # A sample longer than max_len on the last rank: every rank raises, naming it.
    block = random_block(7, rank)
    if rank == last:
        block.seq_lens = block.seq_lens.copy()
        block.seq_lens[3] = MAX_LEN + 1
    expect_error(lambda: rb.exchange(block, step=7), f"rank {last}: sample 3 has length {MAX_LEN + 1}")
    # An empty batch on rank 0 (also started in the background: the error comes out of wait()).
    rb.start(SampleBlock.empty() if rank == 0 else random_block(8, rank), step=8)
    expect_error(rb.wait, "rank 0: its batch is empty")
    # A length of 0 on rank 1.
    block = random_block(9, rank)
    if rank == 1:
        block.seq_lens = block.seq_lens.copy()
        block.seq_lens[0] = 0
    expect_error(lambda: rb.exchange(block, step=9), "rank 1: sample 0 has length 0")
    # Ranks disagreeing on the step.
    expect_error(
        lambda: rb.exchange(random_block(10, rank), step=10 + (rank == 1)),
        "ranks disagree on the step",
        "rank 1 at step 11",
    )
    # The group still works after all of these.
    out, _ = rb.exchange(random_block(12, rank), step=12)
    assert len(out) == B
    # A rank expecting another world size, and one with other settings: fail at construction.
    expect_error(
        lambda: Rebalancer("balanced", batch_size=B, world_size=world + (rank == 1), timeout_s=30),
        f"rank 1: expects world size {world + 1}",
    )
    expect_error(
        lambda: Rebalancer("balanced" if rank != 1 else "stripe", batch_size=B, timeout_s=30),
        "rank 1: strategy 'stripe' differs from rank 0's 'balanced'",
    )
    expect_error(
        lambda: Rebalancer("balanced", batch_size=B + (rank == 1), timeout_s=30),
        f"rank 1: batch_size {B + 1} differs from rank 0's {B}",
    )


def check_timeout(rank: int, world: int) -> None:
    """Rank 1 never calls the exchange: the others get an error after the timeout, not a hang."""
    rb = Rebalancer("balanced", batch_size=B, max_len=MAX_LEN, timeout_s=2)
    if rank == 1:
        time.sleep(4)
        return
    t0 = time.perf_counter()
    expect_error(lambda: rb.exchange(random_block(20, rank), step=20), f"rank {rank}", "step 20")
    took = time.perf_counter() - t0
    assert took < 15, f"the timeout took {took:.1f} s"


def main() -> None:
    rank, world = init()
    check_strategies(rank, world)
    check_ramp(rank, world)
    overlap = check_overlap(rank, world)
    check_measured(rank, world)
    check_bad_input(rank, world)
    if rank == 0:
        print("HIDDEN " + json.dumps(overlap), flush=True)
    if "--timeout" in sys.argv:
        check_timeout(rank, world)
    print(f"REBALANCE-OK rank {rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
