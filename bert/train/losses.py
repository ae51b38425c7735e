"""Pretraining losses: masked-LM + next-sentence, and the SimReg contrastive regulariser.

Every loss is a *sum* over this rank's items divided by a *global* count (all-reduced by the trainer), so it does not
depend on how sequences were spread over ranks; DDP averages gradients over W ranks, the trainer scales the loss by W.

Shape legend: T tokens, B sequences, M masked positions, V vocabulary, C hidden size, N tokens SimReg looks at (M for
scope ``masked``, T for ``all``), L padded block length.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import Tensor

from data.batch import PackedBatch, UnpaddedBatch
from data.packing import unpack
from data.static_shapes import real_part


def _per_count(loss_sum: Tensor, count) -> Tensor:
    """loss_sum / count with count >= 1 (an empty global batch gives 0, not NaN)."""
    if isinstance(count, Tensor):
        return loss_sum / count.to(loss_sum.dtype).clamp(min=1)
    return loss_sum / max(float(count), 1.0)


def pretraining_loss(
    mlm_logits: Tensor,
    mlm_labels: Tensor,
    nsp_logits: Tensor | None,
    nsp_labels: Tensor,
    num_masked_global,
    num_seqs_global,
    with_accuracy: bool = False,
) -> tuple[Tensor, dict]:
    """MLM + NSP loss of this rank's share of the global batch (MLM alone, NSP sums 0, when ``nsp_logits`` is None: no
    next-sentence head). mlm_logits [M, V], mlm_labels [M], nsp_logits [B, 2] or None, nsp_labels [B]; the global counts
    are ints or 0-d tensors. Cross-entropies in float32 (float64 stays float64).

    Returns (loss, stats): detached 0-d tensors ``mlm_loss_sum``, ``nsp_loss_sum``, with ``with_accuracy`` (an argmax
    over [M, V], docs/throughput.md) ``mlm_correct``, ``nsp_correct``, and the local ``num_masked``, ``num_seqs``."""
    dtype = torch.promote_types(mlm_logits.dtype, torch.float32)
    mlm_sum = F.cross_entropy(mlm_logits.to(dtype), mlm_labels, reduction="sum")
    loss = _per_count(mlm_sum, num_masked_global)
    if nsp_logits is None:
        nsp_sum = mlm_sum.new_zeros(())
    else:
        nsp_sum = F.cross_entropy(nsp_logits.to(dtype), nsp_labels, reduction="sum")
        loss = loss + _per_count(nsp_sum, num_seqs_global)
    with torch.no_grad():
        stats: dict = {
            "mlm_loss_sum": mlm_sum.detach(),
            "nsp_loss_sum": nsp_sum.detach(),
            "num_masked": mlm_labels.numel(),
            "num_seqs": nsp_labels.numel(),
        }
        if with_accuracy:
            stats["mlm_correct"] = (mlm_logits.argmax(-1) == mlm_labels).sum()
            no_nsp = nsp_labels.new_zeros(())
            stats["nsp_correct"] = no_nsp if nsp_logits is None else (nsp_logits.argmax(-1) == nsp_labels).sum()
    return loss, stats


SIMREG_SCOPES = ("masked", "all")


def simreg_loss(
    hidden_states: Tensor,
    batch: UnpaddedBatch,
    temperature: float = 0.1,
    scope: str = "masked",
    bucket_width: int = 64,
    counts: list[int] | None = None,
) -> tuple[Tensor, Tensor]:
    """SimReg: supervised contrastive loss between tokens of the same sequence.

    hidden_states: [T, C], the last encoder layer. Tokens: the masked positions labelled by ``mlm_labels`` (scope
    ``masked``) or every token labelled by its original id (scope ``all``: ``input_ids`` with the masked positions'
    ``mlm_labels`` put back). With z the L2-normalised states, candidates A(i) = the other tokens of i's sequence,
    positives P(i) = those with i's label, anchors = tokens with P(i) non-empty:

        L_i = log sum_{a in A(i)} exp(z_i.z_a / t) - (1/|P(i)|) sum_{p in P(i)} z_i.z_p / t

    Returns 0-d device tensors (loss_sum, num_anchors): the sum of L_i over anchors (0 if none) in float32 (float64
    input: float64) and the int64 anchor count. Sequences are batched in buckets of ``bucket_width`` tokens
    (docs/extensions.md), sized from ``counts`` (masked positions per sequence for ``masked``, lengths for ``all``) or
    else read back (one sync)."""
    if scope not in SIMREG_SCOPES:
        raise ValueError(f"loss.simreg_scope: unknown scope {scope!r}; choose from {', '.join(SIMREG_SCOPES)}")
    if not temperature > 0:
        raise ValueError(f"loss.simreg_temperature: must be > 0, got {temperature}")
    if not (isinstance(bucket_width, int) and bucket_width >= 1):
        raise ValueError(f"bucket_width: must be an integer >= 1, got {bucket_width!r}")
    if hidden_states.dim() != 2 or hidden_states.shape[0] != batch.num_tokens:
        raise ValueError(f"hidden_states: expected [{batch.num_tokens}, hidden], got {tuple(hidden_states.shape)}")
    device = hidden_states.device
    dtype = torch.promote_types(hidden_states.dtype, torch.float32)
    cu = batch.cu_seqlens.long()  # [B+1]
    num_seqs = batch.num_sequences

    if scope == "all":
        labels_N = batch.input_ids.clone()
        labels_N[batch.mlm_positions] = batch.mlm_labels
        tokens_N = None  # all T tokens, already grouped by sequence
        counts_B = cu[1:] - cu[:-1]
    else:
        seq_M = torch.searchsorted(cu[1:], batch.mlm_positions, right=True)  # sequence of each masked token
        # Group the masked tokens by sequence (stable: keeps their order within a sequence).
        order = torch.sort(seq_M, stable=True).indices
        tokens_N = batch.mlm_positions[order]
        labels_N = batch.mlm_labels[order]
        counts_B = None if counts is not None else torch.bincount(seq_M, minlength=num_seqs)

    loss_sum = torch.zeros((), dtype=dtype, device=device)
    num_anchors = torch.zeros((), dtype=torch.int64, device=device)
    if counts is None:
        counts = counts_B.tolist()  # the one host sync: block shapes depend on the counts
    elif len(counts) != num_seqs:
        raise ValueError(f"counts: {len(counts)} entries for a batch of {num_seqs} sequences")
    buckets: dict[int, list[int]] = defaultdict(list)  # rounded count -> sequences
    for b, c in enumerate(counts):
        if c >= 2:  # a lone token has no candidates, so it is never an anchor
            buckets[-(-c // bucket_width)].append(b)
    if not buckets:
        return loss_sum, num_anchors

    starts = list(accumulate(counts, initial=0))  # first row of each sequence's tokens in the grouped order
    # (first row, token count) of every sequence, bucket after bucket: one host->device copy,
    # asynchronous (a blocking copy would wait for the device again).
    blocks = [seqs for _, seqs in sorted(buckets.items())]
    ordered = [b for seqs in blocks for b in seqs]
    meta = torch.tensor([[starts[b] for b in ordered], [counts[b] for b in ordered]]).to(device, non_blocking=True)
    with torch.autocast(device_type=device.type, enabled=False):
        h_NC = hidden_states if tokens_N is None else hidden_states[tokens_N]
        z_NC = F.normalize(h_NC.to(dtype), dim=-1)
        first = 0
        for seqs in blocks:
            length = max(counts[b] for b in seqs)
            part = meta[:, first : first + len(seqs)]
            first += len(seqs)
            block_loss, block_anchors = _block_loss(z_NC, labels_N, part[0], part[1], length, temperature)
            loss_sum = loss_sum + block_loss
            num_anchors = num_anchors + block_anchors
    return loss_sum, num_anchors


def simreg_term(hidden_TC: Tensor, batch, block, temperature: float, scope: str, real=None) -> Tensor:
    """SimReg's loss sum over a micro-batch of any layout, on its real tokens: a packed batch is unpacked, a statically
    padded one cut to ``real`` (its (tokens, sequences, masked) without the padding sequence). The counts come from the
    host's ``block`` (a ``SampleBlock``), but for a packed batch, whose rows reorder the sequences."""
    counts = None
    if isinstance(batch, PackedBatch):
        batch, index = unpack(batch)
        hidden_TC = hidden_TC[index]
    else:
        if real is not None:
            batch, hidden_TC = real_part(batch, *real), hidden_TC[: real[0]]
        counts = (block.masked_counts if scope == "masked" else block.seq_lens).tolist()
    return simreg_loss(hidden_TC, batch, temperature, scope, counts=counts)[0]


def _block_loss(
    z_NC: Tensor, labels_N: Tensor, starts_S: Tensor, counts_S: Tensor, length: int, temperature: float
) -> tuple[Tensor, Tensor]:
    """SimReg over S sequences padded to ``length``: rows starts[s] .. starts[s]+counts[s]."""
    ar_L = torch.arange(length, device=z_NC.device)
    valid_SL = ar_L < counts_S[:, None]
    rows_SL = torch.where(valid_SL, starts_S[:, None] + ar_L, 0)
    z_SLC = z_NC[rows_SL]
    lab_SL = labels_N[rows_SL]
    sim_SLL = torch.bmm(z_SLC, z_SLC.transpose(1, 2)) / temperature
    cand_SLL = valid_SL[:, :, None] & valid_SL[:, None, :] & ~torch.eye(length, dtype=torch.bool, device=z_NC.device)
    pos_SLL = cand_SLL & (lab_SL[:, :, None] == lab_SL[:, None, :])
    npos_SL = pos_SLL.sum(-1)
    anchor_SL = npos_SL > 0
    # A finite fill (not -inf) keeps rows without candidates finite: their zeroed losses backpropagate zeros, not NaN.
    lse_SL = torch.logsumexp(sim_SLL.masked_fill(~cand_SLL, torch.finfo(sim_SLL.dtype).min), -1)
    pos_mean_SL = sim_SLL.masked_fill(~pos_SLL, 0).sum(-1) / npos_SL.clamp(min=1)
    per_token = torch.where(anchor_SL, lse_SL - pos_mean_SL, 0)
    return per_token.sum(), anchor_SL.sum()
