"""MLPerf's TensorFlow starting point -> this project's checkpoint or a transformers directory.

    python -m bert.checkpoint.convert_tf --tf-checkpoint model.ckpt-28252 --bert-config bert_config.json \
        --output phase1.pt          # NVIDIA-style {"model": transformers names}, for checkpoint.init
    python -m bert.checkpoint.convert_tf ... --output phase1-hf/   # BertForPreTraining.from_pretrained loads it

Every weight must find its place; ``checkpoint.init`` also takes the prefix directly (docs/training.md).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from bert.checkpoint.pretrained import export_hf
from bert.checkpoint.tf_reader import read_google_bert
from bert.model.hf import load_hf_state_dict, read_config, to_hf_state_dict
from bert.model.pretraining import BertForPreTraining
from common.errors import CheckpointError, ConfigError
from common.files import publishing


def save_pt(model: BertForPreTraining, path: str) -> None:
    """NVIDIA's MLPerf layout ({"model": transformers names}), written under a temporary name."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    state = {k: v.detach().clone().contiguous() for k, v in to_hf_state_dict(model).items()}
    with publishing(path) as tmp:
        torch.save({"model": state}, tmp)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bert.checkpoint.convert_tf", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--tf-checkpoint",
        required=True,
        metavar="PREFIX",
        help="TensorFlow checkpoint prefix (PREFIX.index and PREFIX.data-* exist)",
    )
    p.add_argument("--bert-config", required=True, help="Google BERT's bert_config.json")
    p.add_argument(
        "--output",
        required=True,
        help="ending in .pt: the project's checkpoint for checkpoint.init; else a transformers directory",
    )
    args = p.parse_args(argv)
    try:
        model = BertForPreTraining(read_config(args.bert_config))
        weights, skipped = read_google_bert(args.tf_checkpoint)  # skipped: optimizer slots, counters
        load_hf_state_dict(model, {k: torch.from_numpy(v) for k, v in weights.items()})
        if args.output.endswith(".pt"):
            save_pt(model, args.output)
        else:
            export_hf(model, args.output)
    except (CheckpointError, ConfigError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    n = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.output}: {n:,} parameters; skipped {len(skipped)} variables (optimizer slots, counters)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
