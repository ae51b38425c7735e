"""The attention backends by name: every fact about each, in one list.

``BACKENDS`` holds per backend what nothing may decide by its name: layouts, settings, Triton or
not, CUDA-graph replay, device-side dropout, the config fields of its options. Its code is
imported only when asked for. ``get_backend(name)`` wraps it in the check every call goes
through: a layout or setting it does not take raises ``BackendUnavailable`` naming the backends
that would take it, never swapped. Adding a backend: CONTRIBUTING.md, "Adding an attention backend".
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kernels.interface import (
    SETTINGS,
    AttentionFn,
    BackendUnavailable,
    Layout,
    PackedLayout,
    PaddedLayout,
    VarlenLayout,
    requested_settings,
)
from kernels.runtime import check_runnable

if TYPE_CHECKING:  # importing the registry does not import torch: the configuration names backends first
    from torch import Tensor

_ANY = (VarlenLayout, PaddedLayout, PackedLayout)


@dataclass(frozen=True)
class Backend:
    """One attention backend. ``target``: "module:attribute", the backend function, or with
    ``factory`` a function that returns it (called with the options; it raises
    BackendUnavailable when the backend cannot run here)."""

    name: str
    target: str
    layouts: tuple[type, ...]
    settings: frozenset[str] = frozenset()
    triton: bool = False  # runs the Triton kernels: refused at load when they cannot run here
    factory: bool = False
    options: tuple[str, ...] = ()  # keyword options for the factory (set by model.attention_options)
    graphs: bool = False  # its launches read cu_seqlens on the device: a CUDA graph replays it (docs/step.md)
    device_dropout: bool = False  # its attention dropout draws fresh masks under a graph replay

    def load(self, **options) -> AttentionFn:
        module, attribute = self.target.split(":")
        fn = getattr(importlib.import_module(module), attribute)
        return fn(**options) if self.factory else fn


_WINDOW = frozenset({"window"})
_WINDOW_CROSS = frozenset({"window", "cu_seqlens_k"})

BACKENDS: dict[str, Backend] = {
    b.name: b
    for b in (
        Backend("reference", "kernels.reference:reference_attention", _ANY, _WINDOW_CROSS),
        Backend(
            "padded",
            "kernels.reference:padded_attention",
            (VarlenLayout, PaddedLayout),
            _WINDOW,
            graphs=True,
            device_dropout=True,  # torch's CUDA generator registers its Philox state with the graph
        ),
        Backend("sdpa", "kernels.reference:sdpa_attention", (VarlenLayout,), _WINDOW_CROSS),
        Backend(
            "triton",
            "kernels.varlen_attention:triton_backend",
            (VarlenLayout,),
            _WINDOW_CROSS,
            triton=True,
            graphs=True,
            device_dropout=True,  # the kernels read their Philox state from the device (kernels.runtime)
        ),
        Backend(
            "triton_grouped",  # plans its groups on the host: a replay would freeze one batch's plan
            "kernels.varlen_attention:grouped_backend",
            (VarlenLayout,),
            _WINDOW,
            triton=True,
            factory=True,
            options=("buckets", "num_streams"),
        ),
        Backend("flash_attn", "kernels.library_backends:load_flash_attn", (VarlenLayout,), _WINDOW, factory=True),
        Backend("torch_varlen", "kernels.library_backends:load_torch_varlen", (VarlenLayout,), factory=True),
        Backend("flashmask", "kernels.flashmask:flashmask_backend", (PackedLayout,), triton=True),
    )
}

# What each layout is called in the configuration (``data.layout``), for the messages.
_LAYOUT_CONFIG = {VarlenLayout: "unpadded", PaddedLayout: "padded", PackedLayout: "packed"}


def backend_names() -> list[str]:
    return sorted(BACKENDS)


def _spec(name: str) -> Backend:
    if name not in BACKENDS:
        raise BackendUnavailable(f"model.attention: unknown backend {name!r}; choose one of {backend_names()}")
    return BACKENDS[name]


def layouts_of(name: str) -> tuple[type, ...]:
    """The layouts backend ``name`` takes."""
    return _spec(name).layouts


def backends_for(layout: type, setting: str | None = None) -> list[str]:
    """The backends that take ``layout`` (with ``setting`` on, if given), in BACKENDS' order."""
    return [b.name for b in BACKENDS.values() if layout in b.layouts and (setting is None or setting in b.settings)]


def refusal(name: str, layout: type, settings: Iterable[str] = ()) -> str | None:
    """Why backend ``name`` cannot take a ``layout`` with ``settings`` on, or None when it can."""
    spec = _spec(name)
    if layout not in spec.layouts:
        takes = " or ".join(f"{t.__name__} (data.layout={_LAYOUT_CONFIG[t]})" for t in spec.layouts)
        return (
            f"model.attention={name}: needs a {takes}, got {layout.__name__}; "
            f"{_LAYOUT_CONFIG[layout]} batches run with {', '.join(backends_for(layout))}"
        )
    for setting in settings:
        if setting not in SETTINGS:
            raise ValueError(f"attention setting {setting!r}: not one of {sorted(SETTINGS)}")
        if setting not in spec.settings:
            return (
                f"model.attention={name}: does not implement the attention setting {setting!r} "
                f"({layout.__name__}); backends that do: {', '.join(backends_for(layout, setting))}"
            )
    return None


def graph_refusal(name: str, attention_dropout: float) -> str | None:
    """Why a CUDA graph cannot replay backend ``name`` (with that attention dropout), or None."""
    spec = _spec(name)
    if not spec.graphs:
        safe = [b.name for b in BACKENDS.values() if b.graphs]
        return f"model.attention={name!r} plans its launches on the host; use one of {safe}"
    if attention_dropout > 0 and not spec.device_dropout:
        drawn = [b.name for b in BACKENDS.values() if b.device_dropout]
        return (
            f"model.attention={name!r}'s dropout is not known to draw on the device under a replay; "
            f"use one of {drawn} or attention_probs_dropout_prob=0"
        )
    return None


def check_backend(name: str, layout: type, settings: Iterable[str] = ()) -> None:
    """Raise BackendUnavailable unless backend ``name`` takes ``layout`` with ``settings`` on."""
    if reason := refusal(name, layout, settings):
        raise BackendUnavailable(reason)


def get_backend(name: str, **options) -> AttentionFn:
    """The backend ``name``, checked on every call against the layout and its settings;
    ``options`` go to backends that take some. Raises BackendUnavailable when it cannot run here."""
    spec = _spec(name)
    if unknown := sorted(set(options) - set(spec.options)):
        raise ValueError(f"model.attention={name}: takes no option {unknown}; its options: {list(spec.options)}")
    if spec.triton:
        check_runnable(f"model.attention={name}")
    fn = spec.load(**options)

    @functools.wraps(fn)
    def checked(q: Tensor, k: Tensor, v: Tensor, layout: Layout, dropout_p: float, training: bool) -> Tensor:
        settings = requested_settings(layout)
        if type(layout) not in spec.layouts or not spec.settings.issuperset(settings):
            check_backend(name, type(layout), settings)
        return fn(q, k, v, layout, dropout_p, training)

    checked.backend = spec
    return checked
