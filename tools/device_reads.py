"""Count the host's reads of device tensors: the syncs a training step must not have.

A diagnostic for tests and benchmarks (``tests/bert/train/test_no_device_reads.py``,
``bench/step_sync.py``), not part of the training data flow. On a GPU,
``torch.cuda.set_sync_debug_mode`` sees every sync; on the CPU there is no device to wait
for, so ``DeviceReads`` counts what *would* be a read on a GPU, from inside the process:

- ``aten._local_scalar_dense``, which ``.item()``, ``float(t)``, ``int(t)`` and ``bool(t)``
  dispatch to, on any tensor (seen by a ``TorchDispatchMode``);
- ``.tolist()``, ``.cpu()``, ``.numpy()`` and ``__array__`` of a *device tensor*. These do
  not dispatch on the CPU, so the Python methods are wrapped while counting;
- ops whose output size depends on a device tensor's values (``nonzero``, boolean-mask
  indexing, ``masked_select``, ``unique``, ``bincount``, ``repeat_interleave`` without
  ``output_size``): on a GPU they copy a count back before they can allocate.

Which tensors are device tensors is tracked by taint: the tensors handed to ``mark()`` (the
model's parameters, the optimizer's and clipper's state, ...), whatever ``Tensor.to(...)``
returns (the batch moved to the device), and every output of an op that had a device tensor
among its inputs (activations, gradients, in-place updates, collectives' results). A host
tensor never combined with those (lengths the collator computed, counts agreed by a CPU
group) stays a host tensor and may be read freely. Only the thread that entered the context
is counted: the loader's and the rebalancer's threads are host work by design.

The count errs on the side of a read: on the CPU ``t.to(device)`` returns ``t`` itself, so a
host tensor that was moved is a device tensor from then on (read the host copy *before*
moving it, or keep host facts in NumPy).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

_WRAPPED = ("tolist", "cpu", "numpy", "__array__")
_NOT_WHERE = ("/torch/",)  # frames a read's location skips, besides this module's
# Ops that size their output from a device tensor's values (an implicit read on a GPU).
_SIZED_BY_VALUES = {
    "aten::nonzero",
    "aten::masked_select",
    "aten::_unique",
    "aten::_unique2",
    "aten::unique_dim",
    "aten::unique_consecutive",
    "aten::bincount",
    "aten::repeat_interleave",
}
_INDEXING = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}


def _has_mask(args) -> bool:
    """An indexing op's indices include a boolean mask."""
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ())


class DeviceReads(TorchDispatchMode):
    """``with DeviceReads() as reads: ...``; then ``reads.total`` and ``reads.by_kind``.

    ``reads.log`` keeps (kind, short stack) per read, for a failing test to show where.
    ``paused()`` stops counting for a stretch (set-up between the steps measured).
    """

    def __init__(self, mark: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._device = WeakIdKeyDictionary()
        self.by_kind: Counter[str] = Counter()
        self.log: list[tuple[str, str]] = []
        self._thread = threading.get_ident()
        self._counting = True
        self._originals: dict[str, object] = {}
        self.mark(mark)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def mark(self, tensors: Iterable[torch.Tensor]) -> None:
        """Declare ``tensors`` device tensors (and, through taint, everything made from them)."""
        for t in tensors:
            if isinstance(t, torch.Tensor):
                self._device[t] = True

    def is_device(self, t: torch.Tensor) -> bool:
        return t in self._device

    def reset(self) -> None:
        self.by_kind.clear()
        self.log.clear()

    class _Paused:
        def __init__(self, owner):
            self.owner = owner

        def __enter__(self):
            self.was, self.owner._counting = self.owner._counting, False

        def __exit__(self, *exc):
            self.owner._counting = self.was

    def paused(self):
        return DeviceReads._Paused(self)

    def _count(self, kind: str) -> None:
        if not self._counting or threading.get_ident() != self._thread:
            return
        import traceback

        frames = [
            f
            for f in traceback.extract_stack()
            if f.filename != __file__ and not any(s in f.filename for s in _NOT_WHERE)
        ]
        where = " <- ".join(f"{f.filename.rsplit('/', 1)[-1]}:{f.lineno}" for f in reversed(frames[-4:]))
        self.by_kind[kind] += 1
        self.log.append((kind, where))

    # ---- counting --------------------------------------------------------------------

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten._local_scalar_dense.default:
            self._count("item")  # .item(), float(t), int(t), bool(t)
        inputs = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        on_device = any(a in self._device for a in inputs)
        if on_device and func._schema.name in _SIZED_BY_VALUES and kwargs.get("output_size") is None:
            self._count(func._schema.name.removeprefix("aten::"))
        elif on_device and func._schema.name in _INDEXING and _has_mask(args):
            self._count("mask-index")  # t[mask] and t[mask] = v run nonzero(mask) inside
        out = func(*args, **kwargs)
        if on_device:
            for o in pytree.tree_leaves(out):
                if isinstance(o, torch.Tensor):
                    self._device[o] = True
        return out

    def __enter__(self):
        reads = self
        self._originals = {name: getattr(torch.Tensor, name) for name in _WRAPPED}
        self._originals["to"] = torch.Tensor.to

        def wrap(name):
            original = self._originals[name]

            def read(t, *args, **kwargs):
                if t in reads._device:
                    reads._count(name.strip("_"))
                return original(t, *args, **kwargs)

            return read

        for name in _WRAPPED:
            setattr(torch.Tensor, name, wrap(name))
        original_to = self._originals["to"]

        def to(t, *args, **kwargs):
            out = original_to(t, *args, **kwargs)
            moved = torch._C._nn._parse_to(*args, **kwargs)[0] is not None
            if moved and isinstance(out, torch.Tensor) and threading.get_ident() == reads._thread:
                reads._device[out] = True  # moved to the device (on the CPU: the same tensor)
            return out

        torch.Tensor.to = to
        return super().__enter__()

    def __exit__(self, *exc):
        try:
            return super().__exit__(*exc)
        finally:
            for name, original in self._originals.items():
                setattr(torch.Tensor, name, original)

    def report(self) -> str:
        """One line per read: what and where (the newest frames first)."""
        return "\n".join(f"{kind}: {where}" for kind, where in self.log)
