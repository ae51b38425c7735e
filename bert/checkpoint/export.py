"""A run's checkpoint -> a transformers directory: ``python -m bert.checkpoint.export RUN_DIR --output HF_DIR``.

Rebuilds the model from a checkpoint's stored config and publishes, whole, what ``AutoTokenizer``
and ``AutoModel*.from_pretrained(HF_DIR)`` load offline: docs/extensions.md, "Fine-tuning hand-off".
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

from tokenizers import decoders, processors

from bert.checkpoint import training as train_checkpoint
from bert.checkpoint.pretrained import export_hf
from bert.config import build_config, build_model_config
from bert.model.pretraining import BertForPreTraining
from common.errors import CheckpointError, ConfigError, UserError
from common.files import publishing_dir
from data.prepare.tokenization import load_vocab, make_tokenizer

SPECIAL_TOKENS_MAP = dict(
    unk_token="[UNK]", sep_token="[SEP]", pad_token="[PAD]", cls_token="[CLS]", mask_token="[MASK]"
)


class ExportError(UserError):
    """Bad input; the message is the one line the CLI prints."""


def checkpoint_to_export(run_dir: str, name: str | None) -> str:
    """The checkpoint to export: ``name`` (file or directory name, step number or path) or the newest."""
    directory = os.path.join(run_dir, "checkpoints")
    if name is None:
        found = train_checkpoint.list_checkpoints(directory) if os.path.isdir(directory) else []
        if not found:
            raise ExportError(f"{run_dir}: no checkpoints/step_* (train with checkpoint.interval_steps > 0)")
        return found[-1][1]
    candidates = [name, os.path.join(directory, name)]
    if name.isdigit():
        candidates.append(train_checkpoint.checkpoint_path(directory, int(name)))
    for path in candidates:
        if os.path.isdir(path) and os.path.basename(path).startswith("step_"):
            train_checkpoint.refuse_directory(path)
        if os.path.isfile(path):
            return path
    raise ExportError(f"--checkpoint: {name!r} is neither a file nor a step in {directory}")


def load_run_model(run_dir: str, checkpoint: str | None = None, vocab_file: str | None = None):
    """(model with the checkpoint's weights, vocab.txt path, max_seq_length, checkpoint path). With
    ``checkpoint`` None, the newest that verifies (``bert.checkpoint.training.load_latest``)."""
    path = checkpoint_to_export(run_dir, checkpoint)
    try:
        if checkpoint is None:
            path, state = train_checkpoint.load_latest(os.path.dirname(path), warn=lambda m: print(m, file=sys.stderr))
        else:
            state = train_checkpoint.read(path)
    except CheckpointError as e:
        raise ExportError(str(e)) from e
    if "config" not in state:
        raise ExportError(f"{path}: holds no run config (written by an older trainer)")
    values = dict(state["config"])
    if vocab_file is not None:
        values["data"] = {**values.get("data", {}), "vocab_file": vocab_file}
    try:
        cfg = build_config(values)
        model_config = build_model_config(cfg)
    except ConfigError as e:
        raise ExportError(f"{path}: its config: {e}") from e
    vocab = cfg.data.vocab_file
    if not vocab or not os.path.isfile(vocab):
        raise ExportError(f"the run's data.vocab_file {vocab!r} is not a file here: give --vocab PATH")
    model = BertForPreTraining(model_config)
    try:
        model.load_state_dict(state["model"])
    except RuntimeError as e:
        raise ExportError(
            f"{path}: the weights do not fit the model its config describes ({str(e).splitlines()[0]})"
        ) from e
    return model, vocab, cfg.data.max_seq_length, path


def write_tokenizer_files(directory: str, vocab_file: str, max_length: int) -> None:
    """vocab.txt, tokenizer_config.json and special_tokens_map.json for transformers' BertTokenizer
    (uncased, as data.prepare.tokenization), and tokenizer.json: that WordPiece with BERT's [CLS]/[SEP]
    template, which AutoTokenizer needs where the model type registers no WordPiece class (ModernBERT)."""
    shutil.copyfile(vocab_file, os.path.join(directory, "vocab.txt"))
    with open(vocab_file, encoding="utf-8") as f:
        tokens = {line.rstrip("\n") for line in f}
    missing = [t for t in SPECIAL_TOKENS_MAP.values() if t not in tokens]
    if missing:
        raise ExportError(f"{vocab_file}: the vocabulary lacks {missing}")
    config = dict(tokenizer_class="BertTokenizer", do_lower_case=True, strip_accents=None, tokenize_chinese_chars=True)
    config.update(model_max_length=max_length, clean_up_tokenization_spaces=True, **SPECIAL_TOKENS_MAP)
    for name, content in (("tokenizer_config.json", config), ("special_tokens_map.json", SPECIAL_TOKENS_MAP)):
        with open(os.path.join(directory, name), "w", encoding="utf-8") as f:
            json.dump(content, f, indent=2)
            f.write("\n")
    vocab = load_vocab(vocab_file)
    tok = make_tokenizer(vocab)
    cls, sep = vocab.ids["[CLS]"], vocab.ids["[SEP]"]
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", cls), ("[SEP]", sep)]
    )
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.save(os.path.join(directory, "tokenizer.json"))


def export_run(run_dir: str, output: str, checkpoint: str | None = None, vocab_file: str | None = None) -> str:
    """Write ``output`` (model and tokenizer files); returns the checkpoint exported."""
    model, vocab, max_length, path = load_run_model(run_dir, checkpoint, vocab_file)
    output = os.path.abspath(output)
    with publishing_dir(output) as staging:
        export_hf(model, str(staging))
        write_tokenizer_files(str(staging), vocab, max_length)
    return path


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bert.checkpoint.export", description=__doc__.split("\n\n")[0])
    ap.add_argument("run_dir", metavar="RUN_DIR", help="a training run's --output-dir")
    ap.add_argument("--output", required=True, metavar="HF_DIR", help="the transformers directory to write")
    ap.add_argument(
        "--checkpoint",
        metavar="NAME",
        help="step_XXXXXXXX.pt or step_XXXXXXXX, a step number, or a path (default: newest)",
    )
    ap.add_argument("--vocab", help="vocab.txt (default: the run's data.vocab_file)")
    args = ap.parse_args(argv)
    try:
        path = export_run(args.run_dir, args.output, args.checkpoint, args.vocab)
    except (ExportError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"exported {path} -> {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
