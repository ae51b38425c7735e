"""The batch types the model sees (``UnpaddedBatch``, ``PaddedBatch``, ``PackedBatch``) and the
conversions ``unpad`` (MLPerf's fixed layout -> unpadded) and ``pad``. Structural checks run when
a batch is built and read no tensor value; ``check_values()`` reads values (a sync on CUDA).

Shape legend: T tokens in the flat batch, B sequences, S padded length, M masked positions.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
from torch import Tensor

_INT_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


def _require(ok: bool, field: str, what: str) -> None:
    if not ok:
        raise ValueError(f"{field}: {what}")


def _check_int(batch, names, ndim: int, dtype: torch.dtype | None = None) -> None:
    """Each field of ``names`` an integer tensor of ``ndim`` dimensions (and ``dtype``)."""
    for field in names:
        t = getattr(batch, field)
        _require(isinstance(t, Tensor), field, f"expected a tensor, got {type(t).__name__}")
        _require(t.dtype in _INT_DTYPES, field, f"expected an integer dtype, got {t.dtype}")
        _require(t.dim() == ndim, field, f"expected {ndim} dimension(s), got shape {tuple(t.shape)}")
        _require(dtype is None or t.dtype == dtype, field, f"expected {dtype}, got {t.dtype}")


def _check_same(batch, ref: str, names, what: str = "length") -> None:
    """Each field of ``names`` has the length (or ``what="shape"``: the shape) of field ``ref``."""
    size = (lambda t: tuple(t.shape)) if what == "shape" else (lambda t: t.numel())
    for name in names:
        a, b = size(getattr(batch, name)), size(getattr(batch, ref))
        _require(a == b, name, f"{what} {a} != {ref} {what} {b}")


def _check_labels(nsp_labels: Tensor, ids: dict[str, Tensor], vocab_size: int | None) -> None:
    """NSP labels 0 or 1; with ``vocab_size``, every tensor of ``ids`` in [0, vocab_size)."""
    _require(bool(((nsp_labels == 0) | (nsp_labels == 1)).all()), "nsp_labels", "must be 0 or 1")
    for name, v in ids.items() if vocab_size is not None else ():
        if v.numel():
            lo, hi = int(v.min()), int(v.max())
            _require(lo >= 0 and hi < vocab_size, name, f"token ids must lie in [0, {vocab_size}), got [{lo}, {hi}]")


def to_device(batch, device):
    """``batch`` (any of the batch types) on ``device``: on CUDA an asynchronous copy from pinned host
    memory (docs/step.md); elsewhere ``batch.to(device)``. Tensors already on a GPU stay."""
    if torch.device(device).type == "cuda":
        batch = batch._map(lambda t: t.pin_memory() if t.device.type == "cpu" else t)
    return batch.to(device, non_blocking=True)


class _Batch:
    """What the batch types share: moving, and the sequence count."""

    def _map(self, fn):
        """A copy with ``fn`` applied to every tensor field."""
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return type(self)(**{k: fn(v) if isinstance(v, Tensor) else v for k, v in values.items()})

    def to(self, device, non_blocking: bool = False):
        return self._map(lambda t: t.to(device, non_blocking=non_blocking))

    @property
    def num_sequences(self) -> int:
        return self.nsp_labels.numel()


@dataclass
class UnpaddedBatch(_Batch):
    """A batch of B variable-length sequences flattened to T tokens.

    input_ids, segment_ids, position_ids: [T] int64; positions restart at 0 per sequence.
    cu_seqlens: [B+1] int32, cu_seqlens[0] = 0, cu_seqlens[B] = T; sequence b is the
        tokens cu_seqlens[b]:cu_seqlens[b+1] and its [CLS] is token cu_seqlens[b].
    max_seqlen: the longest sequence, a Python int (kernels size their grids with it).
    mlm_positions: [M] int64 indices into the T tokens; mlm_labels: [M] int64 original ids.
    nsp_labels: [B] int64, 1 when segment B is a random segment.
    host_seqlens: the B lengths as a tuple of Python ints, where the collator knows them
        (None otherwise); they stay on the host when the batch moves (docs/step.md).
    """

    input_ids: Tensor
    segment_ids: Tensor
    position_ids: Tensor
    cu_seqlens: Tensor
    max_seqlen: int
    mlm_positions: Tensor
    mlm_labels: Tensor
    nsp_labels: Tensor
    host_seqlens: tuple[int, ...] | None = None

    def __post_init__(self):
        _check_int(self, ("input_ids", "segment_ids", "position_ids", "mlm_positions", "mlm_labels", "nsp_labels"), 1)
        _check_int(self, ("cu_seqlens",), 1, torch.int32)
        is_int = isinstance(self.max_seqlen, int) and not isinstance(self.max_seqlen, bool)
        _require(is_int, "max_seqlen", f"expected a Python int, got {type(self.max_seqlen).__name__}")
        n = self.input_ids.numel()
        _check_same(self, "input_ids", ("segment_ids", "position_ids"))
        _check_same(self, "mlm_positions", ("mlm_labels",))
        b, cu = self.nsp_labels.numel(), self.cu_seqlens.numel()
        _require(cu == b + 1, "cu_seqlens", f"length {cu} != nsp_labels length {b} + 1")
        if self.host_seqlens is not None:
            lens = self.host_seqlens
            _require(isinstance(lens, tuple), "host_seqlens", f"expected a tuple, got {type(lens).__name__}")
            _require(len(lens) == b, "host_seqlens", f"{len(lens)} lengths for {b} sequences")
            _require(sum(lens) == n, "host_seqlens", f"lengths sum to {sum(lens)} but the batch has {n} tokens")

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def seqlens(self) -> Tensor:
        """[B] int32 sequence lengths."""
        return self.cu_seqlens[1:] - self.cu_seqlens[:-1]

    def check_values(self, vocab_size: int | None = None) -> UnpaddedBatch:
        """Check the contents (reads values: call on the CPU, where batches are made)."""
        t, cu = self.num_tokens, self.cu_seqlens.long()
        _require(self.num_sequences > 0, "nsp_labels", "the batch holds no sequence")
        _require(int(cu[0]) == 0, "cu_seqlens", f"must start at 0, starts at {int(cu[0])}")
        _require(int(cu[-1]) == t, "cu_seqlens", f"ends at {int(cu[-1])} but the batch has {t} tokens")
        lens = cu[1:] - cu[:-1]
        _require(bool((lens >= 1).all()), "cu_seqlens", "every sequence needs at least one token")
        longest = int(lens.max())
        mismatch = f"is {self.max_seqlen} but the longest sequence has {longest} tokens"
        _require(longest == self.max_seqlen, "max_seqlen", mismatch)
        if self.host_seqlens is not None:
            _require(lens.tolist() == list(self.host_seqlens), "host_seqlens", "differ from cu_seqlens' lengths")
        counts_up = torch.equal(self.position_ids.long(), torch.arange(t) - torch.repeat_interleave(cu[:-1], lens))
        _require(counts_up, "position_ids", "must count 0, 1, ... within each sequence")
        if self.mlm_positions.numel():
            pos = self.mlm_positions.long()
            lo, hi = int(pos.min()), int(pos.max())
            _require(lo >= 0 and hi < t, "mlm_positions", f"indices must lie in [0, {t}), got [{lo}, {hi}]")
            _require(not bool(torch.isin(pos, cu[:-1]).any()), "mlm_positions", "a [CLS] token is masked")
        _check_labels(self.nsp_labels, {"input_ids": self.input_ids, "mlm_labels": self.mlm_labels}, vocab_size)
        return self


@dataclass
class PaddedBatch(_Batch):
    """The padded baseline: B sequences each padded to S tokens.

    input_ids, segment_ids, position_ids: [B, S] int64; attention_mask: [B, S] bool (True = real token).
    mlm_positions: [M] int64 flat indices into the B*S tokens; mlm_labels: [M] int64; nsp_labels: [B] int64.
    """

    input_ids: Tensor
    segment_ids: Tensor
    position_ids: Tensor
    attention_mask: Tensor
    mlm_positions: Tensor
    mlm_labels: Tensor
    nsp_labels: Tensor

    def __post_init__(self):
        _check_int(self, ("input_ids", "segment_ids", "position_ids"), 2)
        mask = self.attention_mask
        _require(isinstance(mask, Tensor) and mask.dtype == torch.bool, "attention_mask", "expected a bool tensor")
        _check_same(self, "input_ids", ("segment_ids", "position_ids", "attention_mask"), "shape")
        _check_int(self, ("mlm_positions", "mlm_labels", "nsp_labels"), 1)
        _check_same(self, "mlm_positions", ("mlm_labels",))
        b = self.input_ids.shape[0]
        _require(self.nsp_labels.numel() == b, "nsp_labels", f"length {self.nsp_labels.numel()} != batch size {b}")

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens, the count throughput is reported in."""
        return int(self.attention_mask.sum())


def unpad(
    input_ids, segment_ids, input_mask, masked_lm_positions, masked_lm_ids, next_sentence_labels
) -> UnpaddedBatch:
    """MLPerf's fixed layout -> UnpaddedBatch.

    input_ids, segment_ids, input_mask: [B, S]; input_mask is 1 on real tokens, which form a
    prefix of each row. masked_lm_positions, masked_lm_ids: [B, P], padded with position 0
    ([CLS] is never masked, so 0 marks an unused slot). next_sentence_labels: [B] or [B, 1].
    Accepts tensors or numpy arrays of any integer dtype.
    """
    ids = _as_tensor(input_ids, "input_ids", 2)
    seg = _as_tensor(segment_ids, "segment_ids", 2)
    mask = _as_tensor(input_mask, "input_mask", 2)
    mpos = _as_tensor(masked_lm_positions, "masked_lm_positions", 2)
    mids = _as_tensor(masked_lm_ids, "masked_lm_ids", 2)
    nsp = _as_tensor(next_sentence_labels, "next_sentence_labels", None).reshape(-1)
    b, s = ids.shape
    for name, t in (("segment_ids", seg), ("input_mask", mask)):
        _require(t.shape == ids.shape, name, f"shape {tuple(t.shape)} != input_ids shape {(b, s)}")
    got, want = tuple(mids.shape), tuple(mpos.shape)
    _require(got == want, "masked_lm_ids", f"shape {got} != masked_lm_positions shape {want}")
    _require(mpos.shape[0] == b, "masked_lm_positions", f"has {mpos.shape[0]} rows, input_ids has {b}")
    _require(nsp.numel() == b, "next_sentence_labels", f"has {nsp.numel()} entries, input_ids has {b} rows")
    _require(b > 0, "input_ids", "the batch holds no sequence")

    real = mask != 0  # [B, S]
    lens = real.sum(1)  # [B]
    prefix = torch.arange(s).unsqueeze(0) < lens.unsqueeze(1)
    _require(torch.equal(real, prefix), "input_mask", "real tokens must form a prefix of each row")
    if not bool((lens >= 1).all()):
        raise ValueError(f"input_mask: row {int((lens < 1).nonzero()[0])} has no tokens")

    cu = torch.nn.functional.pad(lens.cumsum(0), (1, 0))  # [B+1]
    used = mpos != 0  # [B, P]
    past = used & (mpos >= lens.unsqueeze(1))
    if bool(past.any()):
        row, col = (int(x) for x in past.nonzero()[0])
        raise ValueError(
            f"masked_lm_positions: row {row} slot {col} is position {int(mpos[row, col])}, "
            f"past the sequence's end ({int(lens[row])} tokens)"
        )
    _require(not bool((mpos < 0).any()), "masked_lm_positions", "negative position")
    flat_pos = (mpos + cu[:-1].unsqueeze(1))[used]  # [M] indices into T
    position_ids = prefix.long().cumsum(1).sub_(1)[real]
    return UnpaddedBatch(
        input_ids=ids[real].long(),
        segment_ids=seg[real].long(),
        position_ids=position_ids,
        cu_seqlens=cu.to(torch.int32),
        max_seqlen=int(lens.max()),
        mlm_positions=flat_pos.long(),
        mlm_labels=mids[used].long(),
        nsp_labels=nsp.long(),
        host_seqlens=tuple(lens.tolist()),
    )


def pad(batch: UnpaddedBatch, seq_len: int | None = None) -> PaddedBatch:
    """UnpaddedBatch -> PaddedBatch with rows of seq_len (default: the batch's max_seqlen)."""
    s = batch.max_seqlen if seq_len is None else int(seq_len)
    _require(s >= batch.max_seqlen, "seq_len", f"{s} is shorter than the longest sequence ({batch.max_seqlen})")
    b = batch.num_sequences
    device = batch.input_ids.device
    lens = batch.seqlens.long()
    mask = torch.arange(s, device=device).unsqueeze(0) < lens.unsqueeze(1)  # [B, S]
    # Flat index of each unpadded token in the [B*S] padded layout.
    seq_of_token = torch.repeat_interleave(torch.arange(b, device=device), lens)  # [T]
    dest = seq_of_token * s + batch.position_ids.long()

    def scatter(values: Tensor) -> Tensor:
        out = torch.zeros(b * s, dtype=values.dtype, device=device)
        out[dest] = values
        return out.view(b, s)

    return PaddedBatch(
        input_ids=scatter(batch.input_ids),
        segment_ids=scatter(batch.segment_ids),
        position_ids=scatter(batch.position_ids),
        attention_mask=mask,
        mlm_positions=dest[batch.mlm_positions.long()],
        mlm_labels=batch.mlm_labels,
        nsp_labels=batch.nsp_labels,
    )


def _as_tensor(x, field: str, ndim: int | None) -> Tensor:
    t = x if isinstance(x, Tensor) else torch.as_tensor(x)
    _require(t.dtype in _INT_DTYPES, field, f"expected an integer dtype, got {t.dtype}")
    if ndim is not None:
        _require(t.dim() == ndim, field, f"expected {ndim} dimensions, got shape {tuple(t.shape)}")
    return t.long()


@dataclass
class PackedBatch(_Batch):
    """R rows of S tokens, each holding one or more whole sequences (B in all), then padding.

    input_ids, segment_ids, position_ids: [R, S] int64, 0 on padding; positions restart at 0 per sequence.
    startend_row_indices: [R, 1, S, 2] int32, FlashMask bounds (LTS, UTE) of the bidirectional
        document mask (docs/packing.md): (e, a) for a key of the sequence on row positions
        [a, e); (0, S) for a padding key, so padding rows see nothing (attention output 0).
    cls_positions: [B] int64 flat indices into the R*S tokens of each sequence's [CLS]
        (its first token); sequence b's tokens are cls_positions[b] + 0 .. seq_lens[b]-1.
    seq_lens: [B] int32; nsp_labels: [B] int64.
    mlm_positions: [M] int64 flat indices into the R*S tokens; mlm_labels: [M] int64.
    Sequences (and their masked positions) keep the order of the samples they came from.
    """

    input_ids: Tensor
    segment_ids: Tensor
    position_ids: Tensor
    startend_row_indices: Tensor
    cls_positions: Tensor
    seq_lens: Tensor
    mlm_positions: Tensor
    mlm_labels: Tensor
    nsp_labels: Tensor

    def __post_init__(self):
        _check_int(self, ("input_ids", "segment_ids", "position_ids"), 2)
        _check_same(self, "input_ids", ("segment_ids", "position_ids"), "shape")
        _check_int(self, ("startend_row_indices",), 4, torch.int32)
        shape = self.input_ids.shape
        got, want = tuple(self.startend_row_indices.shape), (shape[0], 1, shape[1], 2)
        _require(got == want, "startend_row_indices", f"shape {got} != {want}")
        _check_int(self, ("cls_positions", "seq_lens", "mlm_positions", "mlm_labels", "nsp_labels"), 1)
        _check_same(self, "nsp_labels", ("cls_positions", "seq_lens"))
        _check_same(self, "mlm_positions", ("mlm_labels",))

    @property
    def num_rows(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        """Real (unpadded) tokens, the count throughput is reported in."""
        return int(self.seq_lens.sum())

    def token_index(self) -> Tensor:
        """[T] int64: the flat R*S index of each real token, sequence after sequence."""
        lens = self.seq_lens.long()
        starts = torch.repeat_interleave(self.cls_positions.long(), lens)
        first = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        return starts + torch.arange(int(lens.sum()), device=lens.device) - first

    def check_values(self, vocab_size: int | None = None) -> PackedBatch:
        """Check the contents against each other (reads values: call on the CPU)."""
        r, s = self.input_ids.shape
        lens, cls = self.seq_lens.long(), self.cls_positions.long()
        _require(self.num_sequences > 0, "nsp_labels", "the batch holds no sequence")
        _require(bool((lens >= 1).all()), "seq_lens", "every sequence needs at least one token")
        start_col = cls % s
        inside = bool((cls >= 0).all() and (start_col + lens <= s).all())
        _require(inside, "cls_positions", "a sequence runs past the end of its row")
        tokens = self.token_index()
        used = torch.zeros(r * s, dtype=torch.int64)
        used.index_add_(0, tokens, torch.ones_like(tokens))
        _require(int(used.max()) <= 1, "cls_positions", "two sequences overlap")
        counts_up = torch.equal(self.position_ids.reshape(-1)[tokens], tokens - torch.repeat_interleave(cls, lens))
        _require(counts_up, "position_ids", "must count 0, 1, ... within each sequence")
        bounds = self.startend_row_indices.reshape(r * s, 2).long()
        first_col = torch.repeat_interleave(start_col, lens)
        want = torch.stack([first_col + torch.repeat_interleave(lens, lens), first_col], 1)
        ok = torch.equal(bounds[tokens], want)
        _require(ok, "startend_row_indices", "a real token's bounds must be (end, start) of its sequence in the row")
        pad_keys = bounds[used == 0]
        _require(bool((pad_keys == torch.tensor([0, s])).all()), "startend_row_indices", "padding keys must be (0, S)")
        if self.mlm_positions.numel():
            pos = self.mlm_positions.long()
            real = bool(used[pos.clamp(0, r * s - 1)].bool().all()) and int(pos.min()) >= 0 and int(pos.max()) < r * s
            _require(real, "mlm_positions", "a masked position is not a real token")
            _require(not bool(torch.isin(pos, cls).any()), "mlm_positions", "a [CLS] token is masked")
        ids = {"input_ids": self.input_ids.reshape(-1)[tokens], "mlm_labels": self.mlm_labels}
        _check_labels(self.nsp_labels, ids, vocab_size)
        return self
