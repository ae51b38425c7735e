"""Static shapes (``train.static_shapes``): an unpadded micro-batch padded up to a bucket of
tokens and of masked positions, between the collator and the device copy.

The padding is one extra sequence (``cu_seqlens`` and ``host_seqlens`` gain an entry): ids,
segments and positions 0, labels ``IGNORE``, masked positions at its first token; SimReg gets
``real_part``. The sizes and choosing the bucket: [docs/step.md](../docs/step.md#static-shapes).
Shape legend: T tokens, B sequences, M masked positions (padded: T', B + 1, M').
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from data.batch import UnpaddedBatch

IGNORE = -100  # torch.nn.functional.cross_entropy's default ignore_index
MASKED_SHARE = 0.15  # BERT's masking rate: M' is at least this share of T'
ROUND = 64  # buckets are multiples of this (tile and vector widths divide it)
MASKED_BUCKET = ROUND  # masked positions pad to multiples of this


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def auto_token_bucket(micro_batch: int, max_seq_length: int) -> int:
    """The default token bucket: 2% of a full micro-batch, a multiple of 64 (docs/step.md)."""
    return max(ROUND, round_up(math.ceil(0.02 * micro_batch * max_seq_length), ROUND))


@dataclass(frozen=True)
class StaticShapes:
    """``token_bucket``, ``masked_bucket``: the multiples T' and M' round up to; ``max_seqlen``: each padded batch's."""

    token_bucket: int
    masked_bucket: int
    max_seqlen: int

    def __post_init__(self):
        for name in ("token_bucket", "masked_bucket", "max_seqlen"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"static shapes: {name} must be an integer >= 1, got {value!r}")

    def padded_sizes(self, num_tokens: int, num_masked: int) -> tuple[int, int]:
        """(T', M') for a micro-batch of T tokens and M masked positions."""
        tokens = round_up(num_tokens + 1, self.token_bucket)  # at least one token: the padding sequence
        masked = round_up(max(num_masked, math.ceil(MASKED_SHARE * tokens), 1), self.masked_bucket)
        return tokens, masked

    def pad(self, batch: UnpaddedBatch) -> UnpaddedBatch:
        """``batch`` (host tensors) with the padding sequence appended; see the module docstring."""
        t, m = batch.num_tokens, batch.mlm_positions.numel()
        tokens, masked = self.padded_sizes(t, m)
        extra, extra_m = tokens - t, masked - m
        longest = max(extra, batch.max_seqlen)
        if longest > self.max_seqlen:
            raise ValueError(f"static shapes: a sequence of {longest} tokens exceeds max_seqlen {self.max_seqlen}")

        def grow(values: torch.Tensor, n: int, fill: int) -> torch.Tensor:
            return torch.cat([values, torch.full((n,), fill, dtype=values.dtype)])

        return UnpaddedBatch(
            input_ids=grow(batch.input_ids, extra, 0),
            segment_ids=grow(batch.segment_ids, extra, 0),
            position_ids=grow(batch.position_ids, extra, 0),
            cu_seqlens=grow(batch.cu_seqlens, 1, tokens),
            max_seqlen=self.max_seqlen,
            mlm_positions=grow(batch.mlm_positions, extra_m, t),
            mlm_labels=grow(batch.mlm_labels, extra_m, IGNORE),
            nsp_labels=grow(batch.nsp_labels, 1, IGNORE),
            host_seqlens=None if batch.host_seqlens is None else (*batch.host_seqlens, extra),
        )


def real_part(batch: UnpaddedBatch, num_tokens: int, num_sequences: int, num_masked: int) -> UnpaddedBatch:
    """The first ``num_sequences`` sequences of a padded batch, as views (no copy, no device
    read: the real sizes come from the host). ``max_seqlen`` stays the padded batch's bound."""
    return UnpaddedBatch(
        input_ids=batch.input_ids[:num_tokens],
        segment_ids=batch.segment_ids[:num_tokens],
        position_ids=batch.position_ids[:num_tokens],
        cu_seqlens=batch.cu_seqlens[: num_sequences + 1],
        max_seqlen=batch.max_seqlen,
        mlm_positions=batch.mlm_positions[:num_masked],
        mlm_labels=batch.mlm_labels[:num_masked],
        nsp_labels=batch.nsp_labels[:num_sequences],
        host_seqlens=None if batch.host_seqlens is None else batch.host_seqlens[:num_sequences],
    )
