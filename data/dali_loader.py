"""The DALI backend (``backend="dali"``): the loader's SampleBlocks -> batches through a DALI
pipeline that pads on the CPU or a GPU, equal to ``data.collate``'s field by field (docs/data.md#loading).
"""

from __future__ import annotations

import numpy as np
import torch

from data.batch import PaddedBatch, UnpaddedBatch
from data.collate import _check_block, _row_index
from data.samples import SampleBlock, _offsets

_FIELDS = (
    ("input_ids", "INT32", np.int32),
    ("segment_ids", "INT8", np.int8),
    ("masked_positions", "INT32", np.int32),
    ("masked_ids", "INT32", np.int32),
    ("nsp_labels", "INT8", np.int8),
)


class DaliCollator:
    """Callable SampleBlock -> UnpaddedBatch | PaddedBatch through a DALI pipeline.

    layout: ``unpadded`` or ``padded`` (then ``seq_len`` is the row length).
    device_id: None for a CPU pipeline (batches on the CPU), or the GPU to pad on.
    max_batch_size: the most samples one block may hold (blocks may be smaller).
    """

    def __init__(
        self,
        layout: str = "unpadded",
        seq_len: int | None = None,
        device_id: int | None = None,
        max_batch_size: int = 1024,
    ):
        if layout not in ("unpadded", "padded"):
            raise ValueError(f"layout {layout!r}: expected 'unpadded' or 'padded'")
        if layout == "padded" and not seq_len:
            raise ValueError("layout 'padded' needs seq_len")
        try:
            import nvidia.dali.fn as fn
            import nvidia.dali.types as types
            from nvidia.dali import Pipeline
        except ImportError as e:
            raise RuntimeError(f"backend 'dali' needs NVIDIA DALI (pip install nvidia-dali-cuda120): {e}") from e
        self.layout, self.seq_len, self.device_id, self.max_batch_size = layout, seq_len, device_id, max_batch_size
        self.device = torch.device("cpu") if device_id is None else torch.device("cuda", device_id)
        with Pipeline(
            batch_size=max_batch_size,
            num_threads=1,
            device_id=device_id,
            exec_async=False,
            exec_pipelined=False,
            prefetch_queue_depth=1,
        ) as pipe:
            src = {
                name: fn.external_source(name=name, dtype=getattr(types, dt), ndim=1, device="cpu")
                for name, dt, _ in _FIELDS
            }
            data = {k: (v.gpu() if device_id is not None else v) for k, v in src.items()}
            row = {"shape": [seq_len]} if layout == "padded" else {}
            pipe.set_outputs(
                fn.pad(data["input_ids"], fill_value=0, **row),
                fn.pad(data["segment_ids"], fill_value=0, **row),
                fn.pad(data["masked_positions"], fill_value=0),
                fn.pad(data["masked_ids"], fill_value=0),
                data["nsp_labels"],
            )
        pipe.build()
        self._pipe = pipe

    def _to_torch(self, tl) -> torch.Tensor:
        t = tl.as_tensor()
        if self.device_id is None:
            return torch.from_numpy(np.array(t))
        from nvidia.dali.plugin.pytorch import feed_ndarray, to_torch_type

        out = torch.empty(t.shape(), dtype=to_torch_type[t.dtype], device=self.device)
        feed_ndarray(t, out, cuda_stream=torch.cuda.current_stream(self.device))
        return out

    def __call__(self, block: SampleBlock) -> UnpaddedBatch | PaddedBatch:
        b = len(block)
        if b > self.max_batch_size:
            raise ValueError(f"block of {b} samples exceeds the DALI pipeline's max_batch_size {self.max_batch_size}")
        _check_block(block, self.seq_len if self.layout == "padded" else None)
        # The lengths come from the block, on the host: the index arithmetic needs no device read.
        lens_h, mcounts_h = block.seq_lens.astype(np.int64), block.masked_counts.astype(np.int64)
        cu = _offsets(lens_h)
        tok_cuts, msk_cuts = cu[1:-1], _offsets(mcounts_h)[1:-1]
        for name, _, dtype in _FIELDS:
            values = getattr(block, name).astype(dtype, copy=False)
            if name == "nsp_labels":
                samples = list(values.reshape(b, 1))
            else:
                samples = np.split(values, tok_cuts if name in ("input_ids", "segment_ids") else msk_cuts)
            self._pipe.feed_input(name, samples)
        ids_p, seg_p, mpos_p, mids_p, nsp = (self._to_torch(o) for o in self._pipe.run())
        s = ids_p.shape[1]
        tok_index, within = _row_index(lens_h, s)  # [T] into B*S, [T] position in the sequence
        m_index = torch.from_numpy(_row_index(mcounts_h, mpos_p.shape[1])[0]).to(self.device, non_blocking=True)
        mlm_pos = mpos_p.reshape(-1).long()[m_index]  # [M] positions within each sample
        mlm_labels = mids_p.reshape(-1).long()[m_index]
        m_rows = torch.from_numpy(np.repeat(np.arange(b, dtype=np.int64), mcounts_h)).to(self.device)
        nsp_labels = nsp.reshape(b).long()
        if self.layout == "padded":
            pos = torch.arange(s, device=self.device).unsqueeze(0)
            mask = pos < torch.from_numpy(lens_h).to(self.device).unsqueeze(1)  # [B, S]
            return PaddedBatch(
                input_ids=ids_p.long(),
                segment_ids=seg_p.long(),
                position_ids=torch.where(mask, pos, 0),
                attention_mask=mask,
                mlm_positions=m_rows * s + mlm_pos,
                mlm_labels=mlm_labels,
                nsp_labels=nsp_labels,
            )
        index = torch.from_numpy(tok_index).to(self.device, non_blocking=True)
        starts = torch.from_numpy(cu[:-1]).to(self.device)
        return UnpaddedBatch(
            input_ids=ids_p.reshape(-1).long()[index],
            segment_ids=seg_p.reshape(-1).long()[index],
            position_ids=torch.from_numpy(within).to(self.device),
            cu_seqlens=torch.from_numpy(cu.astype(np.int32)).to(self.device),
            max_seqlen=int(lens_h.max()),
            mlm_positions=mlm_pos + starts[m_rows],
            mlm_labels=mlm_labels,
            nsp_labels=nsp_labels,
            host_seqlens=tuple(int(n) for n in lens_h),
        )
