"""Context parallelism: attention over documents split across the N ranks of a CP group.

A document too long for one rank is cut into N contiguous pieces, piece r on rank r
(``ContextShard.piece``); a rank's flat batch holds its whole sequences first, then its pieces
(``ContextLayout``). A global layer all-gathers each split document's K/V, a window layer
exchanges a halo of window // 2 tokens: docs/context_parallel.md, "Attention".
``context_parallel_backend(name)`` wraps a registry backend that takes ``cu_seqlens_k``
(reference, sdpa, triton). Imports torch and kernels only.

Shape legend: T local tokens, P local piece tokens, L one document, N ranks of the CP group,
H heads, D head dim, E tokens of the halo-extended pieces.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor

from kernels.interface import AttentionFn, BackendUnavailable, VarlenLayout
from kernels.registry import get_backend, refusal

# torch 2.13 renamed the tensor collectives (the old names warn); older ones have only the old.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class ContextShard:
    """What one rank of a CP group holds: its whole sequences and its piece of every split
    document (``doc_lens``: the group's, in the same order on every rank)."""

    rank: int
    size: int
    whole_seqlens: tuple[int, ...]
    doc_lens: tuple[int, ...]

    def __post_init__(self):
        if not 0 <= self.rank < self.size:
            raise ValueError(f"context shard: rank {self.rank} outside a group of {self.size}")
        if any(n < 1 for n in (*self.whole_seqlens, *self.doc_lens)):
            raise ValueError("context shard: every sequence and document has at least one token")

    def piece(self, d: int, rank: int | None = None) -> tuple[int, int]:
        """[start, end) of document d's piece on ``rank`` (this one by default), in document positions."""
        length, r = self.doc_lens[d], self.rank if rank is None else rank
        c = -(-length // self.size)
        return min(r * c, length), min((r + 1) * c, length)

    def pieces(self) -> list[tuple[int, int, int]]:
        """(document, start, end) of this rank's non-empty pieces, in its batch order."""
        return [(d, *self.piece(d)) for d in range(len(self.doc_lens)) if self.piece(d)[1] > self.piece(d)[0]]

    @property
    def seqlens(self) -> tuple[int, ...]:
        """The lengths of this rank's local sequences: whole ones, then pieces."""
        return self.whole_seqlens + tuple(e - s for _, s, e in self.pieces())

    @property
    def starts(self) -> tuple[int, ...]:
        """Each local sequence's first position in its whole document (0 for whole sequences)."""
        return (0,) * len(self.whole_seqlens) + tuple(s for _, s, _ in self.pieces())


@dataclass(frozen=True)
class ContextLayout:
    """A rank's batch under context parallelism: ``cu_seqlens`` [B+1] int32 of its local
    sequences (``shard.seqlens``), the CP process group, and the layer's window."""

    cu_seqlens: Tensor
    max_seqlen: int
    shard: ContextShard
    group: object = None  # torch.distributed ProcessGroup; None: the default group
    window: int | None = None


def context_parallel_backend(name: str, **options) -> AttentionFn:
    """The registry backend ``name`` under context parallelism (``VarlenLayout`` batches passed
    through); refuses (one line) a backend without keys of their own."""
    if reason := refusal(name, VarlenLayout, ["cu_seqlens_k"]):
        raise BackendUnavailable(f"dist.context_parallel: {reason}")
    inner = get_backend(name, **options)

    def context_parallel(q: Tensor, k: Tensor, v: Tensor, layout, dropout_p: float, training: bool) -> Tensor:
        if not isinstance(layout, ContextLayout):
            return inner(q, k, v, layout, dropout_p, training)
        return context_attention(q, k, v, layout, dropout_p if training else 0.0, inner, name)

    context_parallel.backend = inner.backend
    return context_parallel


def context_attention(
    q: Tensor, k: Tensor, v: Tensor, layout: ContextLayout, dropout_p: float, inner: AttentionFn, name: str
) -> Tensor:
    """q, k, v [T, H, D] of one rank -> out [T, H, D] (module docstring). ``inner`` is the
    checked backend ``name``; dropout_p already 0 outside training."""
    shard = layout.shard
    if sum(shard.seqlens) != q.shape[0]:
        raise ValueError(f"context attention: {q.shape[0]} tokens for a shard of {sum(shard.seqlens)}")
    tw = sum(shard.whole_seqlens)
    outs = []
    if shard.whole_seqlens:
        nw = len(shard.whole_seqlens)
        whole = VarlenLayout(
            layout.cu_seqlens[: nw + 1], max(shard.whole_seqlens), layout.window, host_seqlens=shard.whole_seqlens
        )
        outs.append(inner(q[:tw], k[:tw], v[:tw], whole, dropout_p, True))
    if shard.doc_lens:  # every rank of the group joins the collectives, with or without tokens
        q_P, k_P, v_P = q[tw:], k[tw:], v[tw:]
        if layout.window is None:
            attend = _TritonCross(dropout_p) if name == "triton" else _Recomputed(inner, dropout_p)
            outs.append(_GlobalPieces.apply(q_P, k_P, v_P, shard, layout.group, attend))
        else:
            outs.append(_halo_attention(q_P, k_P, v_P, shard, layout, inner, dropout_p))
    return torch.cat(outs) if len(outs) > 1 else outs[0]


# ---------------------------------------------------------------------------------------
# Global layers: all-gather K/V per document, reduce-scatter dK/dV.


def _piece_offsets(shard: ContextShard) -> list[tuple[int, int]]:
    """Per split document, (offset among this rank's piece tokens, piece length), 0 if empty."""
    lengths = [e - s for s, e in map(shard.piece, range(len(shard.doc_lens)))]
    return list(zip(itertools.accumulate(lengths, initial=0), lengths))


def _gather_doc(k_n: Tensor, v_n: Tensor, shard: ContextShard, d: int, group) -> Tensor:
    """Document d's K/V from every rank's piece: [N*c, 2, H, D], the document's L rows first."""
    length = shard.doc_lens[d]
    c = -(-length // shard.size)
    send = k_n.new_zeros(c, 2, *k_n.shape[1:])  # [c, 2, H, D]: the piece, padded to c
    send[: k_n.shape[0], 0] = k_n
    send[: k_n.shape[0], 1] = v_n
    full = send.new_empty(shard.size * c, *send.shape[1:])
    _all_gather(full, send, group=group)
    return full  # the document is full[:L]; the rest is padding


def _cu(*offsets: int, device) -> Tensor:
    return torch.tensor(offsets, dtype=torch.int32, device=device)


class _TritonCross:
    """A piece against its document on the Triton kernel family's cross mode: the forward's
    log-sum-exp and dropout seed are kept, so the backward runs no second forward."""

    def __init__(self, dropout_p: float):
        self.dropout_p = dropout_p

    def _call(self, q: Tensor, k: Tensor):
        from kernels.varlen_attention import cross_call  # imported on use: Triton only when asked for

        n, length = q.shape[0], k.shape[0]
        return cross_call(_cu(0, n, device=q.device), n, _cu(0, length, device=q.device), length, self.dropout_p,
                          head_dim=q.shape[-1])  # fmt: skip

    def forward(self, q, k, v):
        out, lse, rng = torch.ops.bert_kernels.attention_fwd(q, k, v, *self._call(q, k))
        return out, (out, lse, rng)

    def backward(self, dout, q, k, v, saved):
        out, lse, rng = saved
        return torch.ops.bert_kernels.attention_bwd(dout.contiguous(), q, k, v, out, lse, rng, *self._call(q, k))


class _Recomputed:
    """A piece against its document on a differentiable backend (reference, sdpa): the forward
    under no_grad, the backward recomputes it with the forward's RNG state (attention dropout)."""

    def __init__(self, inner: AttentionFn, dropout_p: float):
        self.inner, self.dropout_p = inner, dropout_p

    def _run(self, q, k, v):
        n, length = q.shape[0], k.shape[0]
        layout = VarlenLayout(
            _cu(0, n, device=q.device), n, cu_seqlens_k=_cu(0, length, device=q.device), max_seqlen_k=length
        )
        return self.inner(q, k, v, layout, self.dropout_p, True)

    def forward(self, q, k, v):
        rng = torch.get_rng_state() if self.dropout_p > 0 else None
        cuda_rng = torch.cuda.get_rng_state(q.device) if self.dropout_p > 0 and q.is_cuda else None
        with torch.no_grad():
            return self._run(q, k, v), (rng, cuda_rng)

    def backward(self, dout, q, k, v, saved):
        rng, cuda_rng = saved
        devices = [q.device] if q.is_cuda else []
        with torch.random.fork_rng(devices=devices, enabled=rng is not None), torch.enable_grad():
            if rng is not None:
                torch.set_rng_state(rng)
                if cuda_rng is not None:
                    torch.cuda.set_rng_state(cuda_rng, q.device)
            q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
            return torch.autograd.grad(self._run(q, k, v), (q, k, v), dout)


class _GlobalPieces(torch.autograd.Function):
    """This rank's pieces [P, H, D] against their whole documents, one document at a time:
    gather, attend, free; the backward gathers again, and reduce-scatters dK/dV."""

    @staticmethod
    def forward(ctx, q_P, k_P, v_P, shard: ContextShard, group, attend):
        outs, saved = [], []
        for d, (o, n) in enumerate(_piece_offsets(shard)):
            kv_L = _gather_doc(k_P[o : o + n], v_P[o : o + n], shard, d, group)[: shard.doc_lens[d]]
            if n:
                out, kept = attend.forward(q_P[o : o + n], kv_L[:, 0], kv_L[:, 1])
                outs.append(out)
                saved.append(kept)
            del kv_L  # before the next document's gather
        ctx.shard, ctx.group, ctx.attend, ctx.saved = shard, group, attend, saved
        ctx.save_for_backward(q_P, k_P, v_P)
        return torch.cat(outs) if outs else q_P.new_empty(q_P.shape)

    @staticmethod
    def backward(ctx, dout_P):
        q_P, k_P, v_P = ctx.saved_tensors
        shard, group = ctx.shard, ctx.group
        dq_P, dk_P, dv_P = (torch.zeros_like(x) for x in (q_P, k_P, v_P))
        kept = iter(ctx.saved)
        for d, (o, n) in enumerate(_piece_offsets(shard)):
            kv = _gather_doc(k_P[o : o + n], v_P[o : o + n], shard, d, group)
            length = shard.doc_lens[d]
            if n:  # dK/dV written over the gathered K/V, which they no longer need
                dq_P[o : o + n], dk_L, dv_L = ctx.attend.backward(
                    dout_P[o : o + n], q_P[o : o + n], kv[:length, 0], kv[:length, 1], next(kept)
                )
                kv[:length, 0], kv[:length, 1] = dk_L, dv_L
                kv[length:] = 0
                del dk_L, dv_L
            else:  # no piece here: this rank adds nothing
                kv.zero_()
            mine = kv.new_empty(kv.shape[0] // shard.size, *kv.shape[1:])  # [c, 2, H, D]: the sum over ranks, mine
            _reduce_scatter(mine, kv, group=group)
            del kv
            dk_P[o : o + n] = mine[:n, 0]
            dv_P[o : o + n] = mine[:n, 1]
        return dq_P, dk_P, dv_P, None, None, None


# ---------------------------------------------------------------------------------------
# Window layers: the halo of window // 2 tokens each side.


def halo_transfers(shard: ContextShard, reach: int) -> list[tuple[int, int, int, int, int]]:
    """Every (sender, receiver, document, lo, hi): document positions [lo, hi) of the sender's
    piece that the receiver's piece sees within ``reach``, in the order the exchange sends them
    (sender, receiver, document, position). The same list on every rank of the group."""
    out = []
    for s, r in itertools.permutations(range(shard.size), 2):  # (sender, receiver), each ordered pair once
        for d, length in enumerate(shard.doc_lens):
            a, b = shard.piece(d, r)
            sa, sb = shard.piece(d, s)
            if a == b or sa == sb:
                continue
            for lo, hi in ((max(0, a - reach), a), (b, min(length, b + reach))):
                lo, hi = max(lo, sa), min(hi, sb)
                if lo < hi:
                    out.append((s, r, d, lo, hi))
    return out


@dataclass(frozen=True)
class HaloPlan:
    """This rank's side of the halo exchange and of its extended pieces (host lists)."""

    send_index: list[int]  # rows of the P piece tokens to send, receiver by receiver
    send_splits: list[int]  # [N]
    recv_splits: list[int]  # [N]
    kv_index: list[int]  # [E] rows of cat(piece tokens, received tokens) forming the extended pieces
    q_index: list[int]  # [E] rows of cat(piece queries, one zero row): a halo row reads the zero row
    out_index: list[int]  # [P] rows of the extended output that are this rank's own tokens
    ext_seqlens: list[int]  # the extended pieces' lengths


def halo_plan(shard: ContextShard, reach: int) -> HaloPlan:
    transfers = halo_transfers(shard, reach)
    me, offsets = shard.rank, _piece_offsets(shard)
    p_tokens = sum(n for _, n in offsets)
    send_index, send_splits, recv_splits = [], [0] * shard.size, [0] * shard.size
    halo = {}  # document -> (lo, rows of cat(piece tokens, received tokens)) of each transfer to me
    row = p_tokens
    for s, r, d, lo, hi in transfers:
        if s == me:
            start = shard.piece(d)[0]
            send_index.extend(range(offsets[d][0] + lo - start, offsets[d][0] + hi - start))
            send_splits[r] += hi - lo
        if r == me:
            halo.setdefault(d, []).append((lo, range(row, row + hi - lo)))
            recv_splits[s] += hi - lo
            row += hi - lo
    kv_index, q_index, out_index, ext_seqlens = [], [], [], []
    for d, a, b in shard.pieces():
        own = range(offsets[d][0], offsets[d][0] + b - a)
        e0 = len(kv_index)
        for _, rows in sorted([*halo.get(d, []), (a, own)], key=lambda part: part[0]):  # in document order
            if rows is own:
                out_index.extend(range(len(kv_index), len(kv_index) + len(own)))
            kv_index.extend(rows)
            q_index.extend(rows if rows is own else [p_tokens] * len(rows))
        ext_seqlens.append(len(kv_index) - e0)
    return HaloPlan(send_index, send_splits, recv_splits, kv_index, q_index, out_index, ext_seqlens)


class _Exchange(torch.autograd.Function):
    """Rows of x sent to peers (``all_to_all_single``), the received rows out; the backward
    sends their gradients back and adds them where the rows came from."""

    @staticmethod
    def forward(ctx, x, send_index: Tensor, send_splits: list[int], recv_splits: list[int], group):
        ctx.save_for_backward(send_index)
        ctx.shape, ctx.splits, ctx.group = x.shape, (send_splits, recv_splits), group
        recv = x.new_empty(sum(recv_splits), *x.shape[1:])
        dist.all_to_all_single(recv, x.index_select(0, send_index), recv_splits, send_splits, group=group)
        return recv

    @staticmethod
    def backward(ctx, grad):
        (send_index,) = ctx.saved_tensors
        send_splits, recv_splits = ctx.splits
        back = grad.new_empty(sum(send_splits), *grad.shape[1:])
        dist.all_to_all_single(back, grad.contiguous(), send_splits, recv_splits, group=ctx.group)
        return grad.new_zeros(ctx.shape).index_add_(0, send_index, back), None, None, None, None


def _halo_attention(q_P, k_P, v_P, shard: ContextShard, layout: ContextLayout, inner: AttentionFn, dropout_p: float):
    plan = halo_plan(shard, layout.window // 2)
    dev = q_P.device

    def index(rows):
        return torch.tensor(rows, dtype=torch.long, device=dev)

    kv_P = torch.stack((k_P, v_P), 1)  # [P, 2, H, D]
    recv = _Exchange.apply(kv_P, index(plan.send_index), plan.send_splits, plan.recv_splits, layout.group)
    if not plan.ext_seqlens:  # no piece here: nothing to attend, the exchange was for the peers
        return q_P + 0 * recv.sum()  # keeps the exchange in the graph, so its backward runs here too
    kv_E = torch.cat((kv_P, recv)).index_select(0, index(plan.kv_index))
    q_E = torch.cat((q_P, q_P.new_zeros(1, *q_P.shape[1:]))).index_select(0, index(plan.q_index))
    cu = torch.tensor(list(itertools.accumulate(plan.ext_seqlens, initial=0)), dtype=torch.int32, device=dev)
    ext = VarlenLayout(cu, max(plan.ext_seqlens), layout.window, host_seqlens=tuple(plan.ext_seqlens))
    out_E = inner(q_E, kv_E[:, 0], kv_E[:, 1], ext, dropout_p, True)
    return out_E.index_select(0, index(plan.out_index))
