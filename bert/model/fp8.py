"""FP8 matrix multiplies for the encoder's linear layers (``train.fp8``).

``convert_encoder`` swaps every ``nn.Linear`` of ``model.layers`` for torchao's FP8 linear layer,
which keeps its fp32 ``weight`` and ``bias`` under the same names; ``matmul(proj, x)`` is the
bias-free GEMM the fused-ops path calls. Which layers, which scaling and why: [docs/fp8.md](../docs/fp8.md).

Shape legend as in ``bert.model``: N tokens, C in features, O out features.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.errors import ConfigError

RECIPES = ("tensorwise", "rowwise")
# cuBLASLt's FP8 GEMMs need the reduced and output dimensions to be multiples of 16.
ALIGN = 16


@contextlib.contextmanager
def torchao_warnings_held_back():
    """Hold back what torchao logs on its first import (by this module or transformers): its CUDA extensions
    failing to load on a CPU-only torch (float8 training does not use them), torch's pytree's note on an enum."""
    logs = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in logs]
    for log in logs:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(logs, levels):
            log.setLevel(level)


def import_torchao_quietly() -> None:
    """Import torchao, when installed, with its load warnings held back: transformers' import is then silent."""
    with torchao_warnings_held_back(), contextlib.suppress(ImportError):
        import torchao.float8  # noqa: F401
        import torchao.quantization  # noqa: F401  (what transformers imports)


def _torchao():
    try:
        with torchao_warnings_held_back():
            import torchao.float8 as ao_float8
            from torchao.float8 import float8_linear, float8_linear_utils
    except ImportError as e:
        raise ConfigError(f"train.fp8: needs torchao (pip install -r requirements.txt): {e}") from e
    return ao_float8, float8_linear, float8_linear_utils


_fp8_linear_class = None


def _linear_class():
    """The FP8 linear layer, a subclass of torchao's ``Float8Linear`` built on first use (importing
    this module does not import torchao)."""
    global _fp8_linear_class
    if _fp8_linear_class is not None:
        return _fp8_linear_class
    _, float8_linear, _ = _torchao()

    class EncoderFloat8Linear(float8_linear.Float8Linear):
        """torchao's FP8 linear with the autocast dtype of the input's device (torchao reads the
        CUDA autocast state only, so on the CPU it would ignore bf16 autocast) and a bias-free
        GEMM for the fused epilogues."""

        def matmul(self, x_NC: Tensor) -> Tensor:
            """x @ weight.T in FP8, without the bias: [N, C] -> [N, O]."""
            device = x_NC.device.type
            if torch.is_autocast_enabled(device):
                x_NC = x_NC.to(torch.get_autocast_dtype(device))
            return float8_linear.matmul_with_hp_or_float8_args.apply(
                x_NC, self.weight.t(), self.linear_mm_config, self.config
            )

        def forward(self, x_NC: Tensor) -> Tensor:
            y_NO = self.matmul(x_NC)
            return y_NO if self.bias is None else y_NO + self.bias.to(y_NO.dtype)

    _fp8_linear_class = EncoderFloat8Linear
    return EncoderFloat8Linear


def is_fp8(module: nn.Module) -> bool:
    return _fp8_linear_class is not None and isinstance(module, _fp8_linear_class)


def matmul(proj: nn.Linear, x: Tensor) -> Tensor:
    """x @ proj.weight.T without the bias: in FP8 when ``proj`` was converted, else F.linear."""
    return proj.matmul(x) if is_fp8(proj) else F.linear(x, proj.weight)


def check_device(device: torch.device) -> None:
    """FP8 tensor-core GEMMs need compute capability 8.9 (Ada) or 9.0 (Hopper) and later."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ConfigError(
                f"train.fp8: FP8 GEMMs need a GPU of compute capability 8.9 or later; "
                f"{torch.cuda.get_device_name(device)} is {major}.{minor} (use train.fp8=off)"
            )
    elif device.type != "cpu":
        raise ConfigError(f"train.fp8: runs on cuda or cpu, not {device.type}")


def convert_encoder(model: nn.Module, recipe: str, device: torch.device | None = None) -> list:
    """Swap the ``nn.Linear`` layers of the encoder stack ``model.layers`` for FP8 ones in place
    (``recipe`` 'off': nothing). Returns the qualified names converted. Raises ConfigError for what cannot run."""
    if recipe == "off":
        return []
    if device is not None:
        check_device(device)
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList):
        raise ConfigError(f"train.fp8: {type(model).__name__} has no encoder stack 'layers' to convert")
    linears = {f"layers.{name}": m for name, m in layers.named_modules() if isinstance(m, nn.Linear)}
    for name, m in linears.items():
        if m.in_features % ALIGN or m.out_features % ALIGN:
            raise ConfigError(
                f"train.fp8: {name} is {m.in_features} -> {m.out_features}; FP8 GEMMs need both "
                f"sizes to be multiples of {ALIGN}"
            )
    if recipe not in RECIPES:
        raise ConfigError(f"train.fp8: {recipe!r} is not one of {['off', *RECIPES]}")
    ao_float8, _, utils = _torchao()
    # The inner dimension padded to a multiple of 16: the weight-gradient GEMM's is the token count (docs/fp8.md).
    config = dataclasses.replace(ao_float8.Float8LinearConfig.from_recipe_name(recipe), pad_inner_dim=True)
    cls = _linear_class()
    utils.swap_linear_layers(
        model, lambda m: cls.from_float(m, config=config), module_filter_fn=lambda m, fqn: fqn in linears
    )
    return list(linears)


def mlperf_precision(fp8: str, precision: str) -> str:
    """The MLPerf name of the lowest precision a layer computes in: ``fp8`` for the encoder's
    linear layers under ``train.fp8``, else the autocast dtype of ``train.precision``."""
    return "fp8" if fp8 != "off" else {"fp32": "fp32", "bf16": "bfloat16", "fp16": "fp16"}[precision]
