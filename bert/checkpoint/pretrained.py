"""Weights in and out through transformers' files: ``load_pretrained`` initialises from what
``bert.checkpoint.safe_load`` reads; ``export_hf`` publishes what transformers' ``from_pretrained``
loads. The mapping of names and shapes is ``bert.model.hf``'s.
"""

from __future__ import annotations

import json
import os

from bert.checkpoint.safe_load import read_config_and_weights
from bert.model.hf import adapter_for, drop_vocab_padding, load_hf_state_dict, to_hf_state_dict
from common.errors import CheckpointError, ConfigError
from common.files import publishing_dir


def load_pretrained(model, path: str) -> None:
    """Initialise ``model`` from a transformers directory, NVIDIA's MLPerf checkpoint or MLPerf's
    TensorFlow checkpoint prefix (``bert.checkpoint.safe_load.read_config_and_weights``)."""
    config, state_dict = read_config_and_weights(path)
    if config is not None and config != model.config:
        diff = {k: (v, getattr(model.config, k)) for k, v in config.to_dict().items() if getattr(model.config, k) != v}
        raise CheckpointError(f"{path}: config differs from the model's (checkpoint, model): {diff}")
    try:
        rows = adapter_for(model.config).VOCAB_ROWS
        load_hf_state_dict(model, drop_vocab_padding(state_dict, model.config.vocab_size, rows))
    except (CheckpointError, ConfigError) as e:
        raise CheckpointError(f"{path}: {e}") from e


def export_hf(model, directory: str) -> None:
    """Write ``config.json`` and ``model.safetensors`` of the model's family (``BertForPreTraining``,
    ``ModernBertForMaskedLM``); the directory appears complete or not at all."""
    from safetensors.torch import save_file

    family = adapter_for(model.config)
    with publishing_dir(directory) as tmp:
        with open(os.path.join(tmp, "config.json"), "w", encoding="utf-8") as f:
            json.dump(family.config_to_hf(model.config), f, indent=2, sort_keys=True)
            f.write("\n")
        # safetensors stores each tensor once: drop the tied copies, as transformers does.
        tensors = {k: v.detach().contiguous().cpu() for k, v in to_hf_state_dict(model).items() if k not in family.TIED}
        save_file(tensors, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
