"""python -m bert.checkpoint.export: a tiny run's checkpoint loads with transformers' Auto classes
(offline), with a tokenizer that splits text as the project's own WordPiece does."""

import json

import pytest
import torch

from bert.checkpoint import training as train_checkpoint
from bert.checkpoint.export import main as export_main
from data.prepare.tokenization import load_vocab, make_tokenizer
from tests.bert.train.test_trainer import dataset, run_in_process  # noqa: F401 (dataset is a fixture)

WORDS = [
    "the",
    "cat",
    "dog",
    "sat",
    "on",
    "mat",
    "fast",
    "and",
    "ran",
    "far",
    "away",
    "big",
    "small",
    "red",
    "house",
    "tree",
    "river",
    "over",
    ".",
    ",",
]
TEXT = "The big cat sat on the red mat, and the dogs ran far away."


def write_vocab(path):
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    tokens = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + WORDS + letters + ["##" + c for c in letters]
    tokens += [f"##{w}" for w in WORDS[: 96 - len(tokens)]]
    assert len(tokens) == 96  # the tiny model's vocabulary size
    path.write_text("".join(t + "\n" for t in tokens))
    return path


@pytest.fixture(scope="module")
def exported(dataset, tmp_path_factory):  # noqa: F811
    root = tmp_path_factory.mktemp("export")
    vocab = write_vocab(root / "vocab.txt")
    run = root / "run"
    run_in_process(dataset, run, "train.max_steps=3", "checkpoint.interval_steps=1", f"data.vocab_file={vocab}")
    assert export_main([str(run), "--output", str(root / "hf")]) == 0
    assert export_main([str(run), "--output", str(root / "hf1"), "--checkpoint", "1"]) == 0
    return root, run


def test_export_loads_with_auto_classes(exported):
    transformers = pytest.importorskip("transformers")
    root, run = exported
    hf = root / "hf"
    assert {"config.json", "model.safetensors", "vocab.txt", "tokenizer_config.json", "special_tokens_map.json"} <= {
        p.name for p in hf.iterdir()
    }
    tok = transformers.AutoTokenizer.from_pretrained(str(hf), local_files_only=True)
    ours = make_tokenizer(load_vocab(root / "vocab.txt"))
    assert tok(TEXT, add_special_tokens=False)["input_ids"] == ours.encode(TEXT).ids
    ids = tok(TEXT)["input_ids"]
    assert ids[0] == tok.cls_token_id == 2 and ids[-1] == tok.sep_token_id == 3
    assert tok.mask_token == "[MASK]" and tok.pad_token_id == 0

    model = transformers.AutoModelForSequenceClassification.from_pretrained(
        str(hf), num_labels=3, local_files_only=True
    )
    state = train_checkpoint.read(train_checkpoint.checkpoint_path(str(run / "checkpoints"), 2))["model"]
    emb = state["embeddings.word.weight"]
    assert torch.equal(model.bert.embeddings.word_embeddings.weight.detach(), emb)
    logits = model(**tok([TEXT, "a cat"], padding=True, return_tensors="pt")).logits
    assert logits.shape == (2, 3)

    # --checkpoint 1 exports the older weights, not the newest.
    older = transformers.AutoModel.from_pretrained(str(root / "hf1"), local_files_only=True)
    assert not torch.equal(older.embeddings.word_embeddings.weight.detach(), emb)
    assert json.loads((hf / "config.json").read_text())["vocab_size"] == 96


def test_export_bad_input_is_one_line(exported, tmp_path, capsys):
    _, run = exported
    assert export_main([str(tmp_path), "--output", str(tmp_path / "hf")]) == 2
    assert export_main([str(run), "--output", str(tmp_path / "hf"), "--checkpoint", "7"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("error: ") for line in err)
    assert "--checkpoint" in err[1]
    assert not (tmp_path / "hf").exists()


def test_finetune_task_is_balanced_and_held_out():
    from bench.finetune import make_task

    names, train, test = make_task(3, 12, 1 / 3, seed=0)
    assert len(names) == 3
    for label in range(3):
        assert sum(1 for _, y in test if y == label) == len(test) // 3
        assert sum(1 for _, y in train if y == label) == len(train) // 3
    assert not {t for t, _ in train} & {t for t, _ in test}
    assert make_task(3, 12, 1 / 3, seed=0) == (names, train, test)  # seeded


def test_finetune_compares_both_arms_on_the_export(exported, tmp_path, capsys):
    from bench.finetune import main as finetune_main

    root, _ = exported
    out = tmp_path / "ft.json"
    assert (
        finetune_main(
            [
                str(root / "hf"),
                "--topics",
                "2",
                "--epochs",
                "1",
                "--max-length",
                "32",
                "--threads",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    assert set(result["results"]) == {"pretrained", "random init"}
    assert all(0 <= r["test_accuracy"] <= 1 for r in result["results"].values())
    assert "fine-tuning comparison: pretrained" in capsys.readouterr().out
    assert finetune_main([str(tmp_path), "--epochs", "1"]) == 2
