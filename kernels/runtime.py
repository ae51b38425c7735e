"""Where the Triton kernels run (compiled for a CUDA GPU, or Triton's interpreter on CPU), and
the dropout RNG every kernel draws from.

Triton fixes its mode when first imported, so ``jit_kernels(device, what, source)`` loads each
device-code file in that mode, or raises ``BackendUnavailable`` saying what to change; it never
falls back. For CPU test runs, set ``TRITON_INTERPRET=1`` before anything imports Triton.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

import torch

from kernels.interface import BackendUnavailable

_SOURCE = Path(__file__).with_name("triton_jit.py")
_LOADED: dict[tuple[Path, bool], ModuleType] = {}


def seeded_op_tags() -> dict:
    """``torch.library.custom_op``'s ``tags=`` marking an op that draws random numbers, where this
    torch takes it (docs/kernels.md, "Contracts")."""
    if "tags" in inspect.signature(torch.library.custom_op).parameters:
        return {"tags": (torch.Tag.nondeterministic_seeded,)}
    return {}


_DEVICE_STATES: list[torch.Tensor] = []  # the innermost ``philox_from`` state last


def philox_state(device: torch.device | str) -> torch.Tensor:
    """A fresh device-resident Philox state: [2] int64 (seed, offset) on ``device``, zeros."""
    return torch.zeros(2, dtype=torch.int64, device=device)


def seed_philox_(state: torch.Tensor, seed: int) -> torch.Tensor:
    """Set ``state`` to (seed, 0) in place from the host: two fills, no read of the device,
    and the state keeps its address, so a captured graph that reads it sees the new seed."""
    state[0].fill_(int(seed) & (2**63 - 1))
    state[1].zero_()
    return state


@contextmanager
def philox_from(state: torch.Tensor):
    """Inside, every kernel draw takes its (seed, offset) from the device tensor ``state``
    and advances its offset on the device (graph-capturable); outside, from torch's
    default generator as before."""
    _DEVICE_STATES.append(state)
    try:
        yield state
    finally:
        _DEVICE_STATES.pop()


def draw_philox(dropout_p: float, device: torch.device | str = "cpu") -> torch.Tensor:
    """[2] int64 on ``device``: the (seed, offset) of one launch's Philox dropout, read by the
    kernels through a pointer; zeros, drawing nothing, without dropout.

    Inside ``philox_from(state)``: a copy of ``state``, whose offset then advances by 1 on the
    device. Outside: drawn from torch's default generator (``torch.manual_seed`` reproduces it),
    refused while a CUDA graph is captured (the graph would freeze the host's copy)."""
    if dropout_p <= 0.0:
        return torch.zeros(2, dtype=torch.int64, device=device)
    if _DEVICE_STATES:
        state = _DEVICE_STATES[-1]
        if state.device != torch.device(device):
            raise ValueError(f"dropout RNG: the Philox state is on {state.device}, the tensors on {device}")
        pair = state.clone()
        state[1].add_(1)
        return pair
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "dropout RNG: a CUDA graph is being captured but the kernels' Philox state is torch's host "
            "generator, which the graph would freeze; capture inside kernels.runtime.philox_from(state)"
        )
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64)
    offset = torch.randint(0, 2**31 - 1, (1,), dtype=torch.int64)
    return torch.cat([seed, offset]).to(device)


def triton_available() -> str | None:
    """None when Triton can be imported, else the reason it cannot."""
    try:
        import triton  # noqa: F401
    except ImportError as e:  # the package is optional on CPU-only installs
        return f"the triton package cannot be imported ({e})"
    return None


def triton_interpreted() -> bool:
    """Whether this process's Triton was imported in interpreter mode (imports it if needed)."""
    import triton.language.random as random
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(random.philox, InterpretedFunction)


def check_runnable(what: str) -> None:
    """Raise BackendUnavailable when the Triton kernels cannot run on this machine at all."""
    if reason := triton_available():
        raise BackendUnavailable(f"{what}: {reason}")
    if not torch.cuda.is_available() and not triton_interpreted():
        raise BackendUnavailable(
            f"{what}: no CUDA GPU here; set TRITON_INTERPRET=1 (before Python starts) to run the "
            "Triton kernels in Triton's interpreter on CPU (slow: for tests), or run on a GPU"
        )


def jit_kernels(device: torch.device, what: str = "triton kernels", source: Path = _SOURCE) -> ModuleType:
    """The device-code module ``source`` (default: the attention family's), after checking that
    its kernels can run on ``device`` in this process."""
    if reason := triton_available():
        raise BackendUnavailable(f"{what}: {reason}")
    interpreted = triton_interpreted()
    if device.type == "cpu" and not interpreted:
        raise BackendUnavailable(
            f"{what}: the tensors are on the CPU but Triton runs compiled in this process (it was "
            "imported without TRITON_INTERPRET=1); set TRITON_INTERPRET=1 before Python starts to use "
            "Triton's interpreter (slow: for tests), or move the tensors to a GPU"
        )
    if device.type not in ("cpu", "cuda"):
        raise BackendUnavailable(
            f"{what}: tensors on {device.type!r}; the Triton kernels need CUDA (or CPU with TRITON_INTERPRET=1)"
        )
    return device_code(interpreted, source)


def device_code(interpret: bool, source: Path = _SOURCE) -> ModuleType:
    """``load(interpret, source)``, once per process (the module every caller shares)."""
    if (source, interpret) not in _LOADED:
        _LOADED[source, interpret] = load(interpret, source)
    return _LOADED[source, interpret]


def _fix_interpreter_scalars() -> None:
    """Let Triton's interpreter use loaded scalars as loop bounds under NumPy >= 2.4 (only where
    ``int`` of a 1-element array fails): docs/kernels.md, "Versions"."""
    import numpy as np
    from triton.runtime import interpreter

    try:
        int(np.zeros(1, dtype=np.int32))
        return
    except TypeError:
        pass
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_reads_scalar_element", False):
        return

    def patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patch_lang_tensor._reads_scalar_element = True
    interpreter._patch_lang_tensor = patch_lang_tensor


def load(interpret: bool, source: Path = _SOURCE) -> ModuleType:
    """Execute the device-code file ``source`` as a fresh module whose @triton.jit functions are
    built for the interpreter or for compilation (also without a GPU: tools/compile_check.py),
    in the mode Triton was imported in."""
    if interpret:
        _fix_interpreter_scalars()
    stem = "jit" if source == _SOURCE else f"jit_{source.stem}"
    name = f"kernels._{stem}_{'interpreted' if interpret else 'compiled'}"
    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if interpret else "0"
    try:
        spec = importlib.util.spec_from_file_location(name, source)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # Triton resolves helper functions through the module
        spec.loader.exec_module(module)
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved
    return module
