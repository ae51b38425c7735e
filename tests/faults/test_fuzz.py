"""Hostile input, generated: HDF5 shards (built wrong and damaged byte by byte), the text that
data.prepare reads, and the run configuration (YAML and overrides). Every outcome is a valid
result or the project's own error (DataError, ConfigError) with a message; never another
exception, a hang (pytest-timeout) or a crash.

Hypothesis is derandomized (the same cases on every run; a failure prints the case) and keeps
no example database. Each test also counts its outcomes and checks that both kinds occur, so the generators reach
the readers' success paths as well as their errors. Cases: 500 + 400 HDF5, 250 prepare,
500 + 500 + 300 config: 2,450."""

from __future__ import annotations

import tempfile
from pathlib import Path

import h5py
import numpy as np
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bert.config import RunConfig, build_config, load_config
from common.errors import ConfigError, DataError
from data.hdf5io import FIXED_KEYS, VARLENGTH_KEYS, inspect, read_file, read_valid, write_fixed, write_varlength
from data.prepare.shards import PrepareConfig, prepare
from data.rebalance.exchange import check_block
from tests.batches import fixed_layout

pytestmark = pytest.mark.slow  # 2,450 generated cases

FUZZ = dict(
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much],
)
V = 50  # vocabulary of the generated samples


@pytest.fixture(scope="module")
def scratch():
    with tempfile.TemporaryDirectory() as d:
        yield Path(d)


# ---- HDF5 readers -----------------------------------------------------------------------------


def check_readers(path: Path, vocab_size) -> str:
    """What every reader may do with any file: succeed consistently or raise DataError.
    Returns which: "read" or "rejected"."""
    try:
        info = inspect(path)
    except DataError as e:
        assert str(e).startswith(f"{path}: ")
        info = None
    try:
        block = read_file(path, vocab_size=vocab_size)
    except DataError as e:
        assert str(e).startswith(f"{path}: ")
        block = None
    valid, rows, problems = read_valid(path, vocab_size=vocab_size)  # never raises
    assert len(valid) == len(rows) and all(p.startswith(f"{path}: ") for p in problems)
    if block is not None:
        assert info is not None and len(block) == info.num_samples
        assert not problems and valid.equals(block)
        if len(block):
            assert check_block(block, len(block), 1 << 15)[0] == 0
            if vocab_size is not None:
                assert int(block.input_ids.max()) < vocab_size and int(block.masked_ids.max(initial=0)) < vocab_size
    elif info is not None:
        assert problems  # a file that opens but does not read names its bad samples
    return "read" if block is not None else "rejected"


def run_counted(test) -> dict:
    """Run a @given function that returns an outcome; the outcomes counted."""
    counts: dict = {}
    test(counts)
    return counts


def _valid_arrays(draw, n: int) -> dict:
    lengths = draw(st.lists(st.integers(1, 12), min_size=n, max_size=n))
    return fixed_layout(lengths, V, seq_len=12, max_predictions=4, seed=draw(st.integers(0, 1000)))


MUTATIONS = (
    "drop",
    "group",
    "float",
    "uint8",
    "bool",
    "bytes",
    "extra_dim",
    "no_dim",
    "short",
    "value",
    "value",
    "value",
    "attr",
)


@st.composite
def built_files(draw):
    """A fixed or varlength file, valid or broken by a few drawn mutations."""
    n = draw(st.integers(0, 6))
    a = {k: v.astype(np.int64) for k, v in _valid_arrays(draw, n).items()}
    varlength = draw(st.booleans())
    keys = list(VARLENGTH_KEYS if varlength else FIXED_KEYS)
    mutations = draw(
        st.lists(
            st.tuples(
                st.sampled_from(MUTATIONS), st.sampled_from(keys), st.integers(-40000, 40000), st.integers(0, 100)
            ),
            max_size=3,
        )
    )
    return varlength, a, mutations


def write_built(path: Path, varlength: bool, a: dict, mutations) -> None:
    lens = a["input_mask"].sum(1)
    counts = (a["masked_lm_positions"] != 0).sum(1)
    if varlength:
        data = {
            "input_ids": [a["input_ids"][i, : lens[i]] for i in range(len(lens))],
            "segment_ids": [a["segment_ids"][i, : lens[i]] for i in range(len(lens))],
            "masked_lm_positions": [a["masked_lm_positions"][i, : counts[i]] for i in range(len(lens))],
            "masked_lm_ids": [a["masked_lm_ids"][i, : counts[i]] for i in range(len(lens))],
        }
        dtypes = {
            "input_ids": np.int16,
            "segment_ids": np.int8,
            "masked_lm_positions": np.int16,
            "masked_lm_ids": np.int16,
        }
    else:
        data = {k: a[k] for k in FIXED_KEYS[:-1]}
        dtypes = {
            "input_ids": np.int16,
            "input_mask": np.int8,
            "segment_ids": np.int8,
            "masked_lm_positions": np.int16,
            "masked_lm_ids": np.int16,
        }
    data["next_sentence_labels"] = a["next_sentence_labels"]
    dtypes["next_sentence_labels"] = np.int8
    attrs = {}
    for kind, key, value, where in mutations:
        x = data.get(key)
        if x is None or isinstance(x, str):  # dropped, or already a group
            continue
        if kind == "drop":
            data.pop(key)
        elif kind == "group":
            data[key] = "group"
        elif kind in ("float", "uint8", "bool", "bytes"):
            dtypes[key] = {"float": np.float32, "uint8": np.uint8, "bool": np.bool_, "bytes": "S3"}[kind]
        elif kind == "extra_dim" and not isinstance(x, list):
            data[key] = np.asarray(x)[..., None]
        elif kind == "no_dim" and not isinstance(x, list):
            data[key] = np.asarray(x).reshape(-1)
        elif kind == "short":
            data[key] = x[:-1] if len(x) else x
        elif kind == "value" and len(x):
            if isinstance(x, list):
                row = x[where % len(x)]
                if len(row):
                    row = row.copy()
                    row[where % len(row)] = value
                    x[where % len(x)] = row
            else:
                flat = np.array(x).reshape(-1)
                if flat.size:
                    flat[where % flat.size] = value
                    data[key] = flat.reshape(np.shape(x))
        elif kind == "attr":
            attrs["max_seq_length"] = [value, "x", np.array([1, 2]), -1][where % 4]
    with h5py.File(path, "w") as f:
        for key, x in data.items():
            if isinstance(x, str):
                f.create_group(key)
            elif isinstance(x, list):
                base = dtypes[key] if dtypes[key] != "S3" else np.int16
                ds = f.create_dataset(key, (len(x),), dtype=h5py.vlen_dtype(np.dtype(base)))
                for i, row in enumerate(x):
                    ds[i] = np.asarray(row).astype(base)  # wraps out-of-range values, as a bad writer would
            else:
                dt = dtypes[key]
                arr = np.asarray(x)
                f.create_dataset(key, data=arr.astype(dt) if dt != "S3" else arr.astype(str).astype("S3"))
        for k, v in attrs.items():
            f.attrs[k] = v


def test_hdf5_readers_on_built_files(scratch):
    @settings(max_examples=500, **FUZZ)
    @given(built=built_files(), vocab=st.sampled_from([None, V, 10]))
    def one(counts, built, vocab):
        path = scratch / "built.hdf5"
        write_built(path, *built)
        outcome = check_readers(path, vocab)
        counts[outcome] = counts.get(outcome, 0) + 1

    counts = run_counted(one)
    assert counts.get("read", 0) >= 50 and counts.get("rejected", 0) >= 100, counts


@pytest.fixture(scope="module")
def originals(scratch):
    """A valid file of each layout, as bytes."""
    from data.hdf5io import from_fixed_arrays

    a = fixed_layout(list(range(1, 25)), V, seq_len=24, max_predictions=4, seed=3)
    block = from_fixed_arrays("x", a)
    out = {}
    for name, write in (
        ("fixed", lambda p: write_fixed(p, block, 24, 4)),
        ("varlength", lambda p: write_varlength(p, block, 24, 4)),
    ):
        write(scratch / f"{name}.hdf5")
        out[name] = (scratch / f"{name}.hdf5").read_bytes()
    return out


def test_hdf5_readers_on_damaged_bytes(scratch, originals):
    @settings(max_examples=400, **FUZZ)
    @given(layout=st.sampled_from(["fixed", "varlength"]), data=st.data())
    def one(counts, layout, data):
        raw = bytearray(originals[layout])
        edits = data.draw(
            st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), min_size=1, max_size=8)
        )
        for at, byte in edits:
            raw[at] = byte
        cut = data.draw(st.one_of(st.none(), st.none(), st.integers(0, len(raw))))
        path = scratch / "damaged.hdf5"
        path.write_bytes(bytes(raw[:cut]))
        outcome = check_readers(path, data.draw(st.sampled_from([None, V])))
        counts[outcome] = counts.get(outcome, 0) + 1

    counts = run_counted(one)
    assert counts.get("read", 0) >= 20 and counts.get("rejected", 0) >= 100, counts


# ---- data.prepare's text input ---------------------------------------------------------------

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "mat",
    "Dr.",
    "U.S.",
    "e.g.",
    "=",
    "= = Title = =",
    "@-@",
    "@,@",
    "<unk>",
    ".",
    "!",
    "?",
    '"',
    "(",
    ")",
    "1999",
    "A",
    "B",
    "\u00e9t\u00e9",
    "\u4e2d\u6587",
    "\U0001f600",
    "\t",
    "\r",
    "\x00",
    "\ufeff",
    "\u2028",
]
LINES = (
    st.lists(
        st.one_of(st.lists(st.sampled_from(WORDS), max_size=12).map(" ".join), st.just(""), st.text(max_size=30)),
        max_size=40,
    )
    .map("\n".join)
    .map(lambda t: t.encode("utf-8"))
)
SENTENCE = st.lists(st.sampled_from(WORDS), min_size=1, max_size=10).map(lambda ws: "The " + " ".join(ws) + ".")
DOCS = st.lists(st.lists(SENTENCE, min_size=1, max_size=5).map("\n".join), min_size=2, max_size=6).map(
    lambda docs: "\n\n = Title = \n\n".join(docs).encode("utf-8")
)


def _noisy(text_and_noise) -> bytes:
    text, noise = text_and_noise
    for at, junk in noise:
        at %= len(text) + 1
        text = text[:at] + junk + text[at:]
    return text


RAW = st.one_of(
    DOCS,
    st.tuples(DOCS, st.lists(st.tuples(st.integers(0, 10**4), st.binary(max_size=6)), min_size=1, max_size=4)).map(
        _noisy
    ),
    LINES,
    st.binary(max_size=300),
    LINES.map(lambda b: b[: len(b) // 2] + b"\xff\xfe\xc0" + b[len(b) // 2 :]),
)
PIECES = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *'abcdefghijklmnopqrstuvwxyz.!?"()', "the", "cat", "##s"]


def test_prepare_on_any_text(scratch):
    vocab = scratch / "vocab.txt"
    vocab.write_text("\n".join(PIECES) + "\n")

    @settings(max_examples=250, **FUZZ)
    @given(
        raw=RAW,
        fmt=st.sampled_from(["bert", "wikitext", "text"]),
        eval_samples=st.sampled_from([0, 3]),
        train_vocab=st.sampled_from([None, None, 60]),
        min_sentences=st.sampled_from([1, 2]),
    )
    def one(counts, raw, fmt, eval_samples, train_vocab, min_sentences):
        src = scratch / "input.txt"
        src.write_bytes(raw)
        out = scratch / "prepared"
        cfg = PrepareConfig(
            inputs=[str(src)],
            output_dir=str(out),
            input_format=fmt,
            max_seq_length=16,
            max_predictions=3,
            dupe_factor=1,
            shards=1,
            eval_samples=eval_samples,
            workers=1,
            min_sentences=min_sentences,
            vocab=None if train_vocab else str(vocab),
            train_vocab=train_vocab,
        )
        try:
            manifest = prepare(cfg, log=lambda m: None).manifest
        except DataError as e:
            assert str(e) and "\n" not in str(e)
            counts["rejected"] = counts.get("rejected", 0) + 1
            return
        files = sorted((out / "train").glob("*.hdf5"))
        assert len(files) == 1
        block = read_file(files[0], vocab_size=manifest["vocab"]["size"])
        assert len(block) == manifest["train"]["samples"] > 0
        counts["prepared"] = counts.get("prepared", 0) + 1

    counts = run_counted(one)
    assert counts.get("prepared", 0) >= 50 and counts.get("rejected", 0) >= 50, counts


# ---- the run configuration -------------------------------------------------------------------


def _field_keys() -> list[str]:
    import dataclasses

    keys = []
    for section in dataclasses.fields(RunConfig):
        for f in dataclasses.fields(section.default_factory):
            keys.append(f"{section.name}.{f.name}")
    return keys + ["optim.adagc.beta", "optim.adagc.warmup_steps", "optim.adagc.nope", "nope.x", "model", "a.b.c.d"]


KEYS = _field_keys()


def _plausible() -> st.SearchStrategy:
    """section.field=value with a value of the field's kind near its default: valid often."""
    import dataclasses

    options = []
    for section in dataclasses.fields(RunConfig):
        for f in dataclasses.fields(section.default_factory):
            if dataclasses.is_dataclass(f.default_factory if f.default is dataclasses.MISSING else f.default):
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            choices = f.metadata.get("choices")
            if choices:
                values = st.sampled_from([*choices, "bogus"])
            elif isinstance(default, bool):
                values = st.booleans()
            elif isinstance(default, int):
                values = st.integers(-2, 2 * default + 2)
            elif isinstance(default, float):
                values = st.floats(-1.0, 2 * default + 1.0)
            elif isinstance(default, (list, tuple)):
                values = st.lists(st.integers(0, 9), max_size=3)
            else:
                values = st.one_of(st.none(), st.text(max_size=5))
            options.append(
                values.map(
                    lambda v, k=f"{section.name}.{f.name}": f"{k}={yaml.safe_dump(v).strip()}".replace("\n...", "")
                )
            )
    return st.one_of(options)


SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**70), 2**70),
    st.floats(),
    st.text(max_size=12),
    st.sampled_from(
        ["tiny", "global", "adagc", "fp32", "skip", "stop", "gloo", "1e-3", ".nan", "-.inf", "[0.9, 0.98]", "{a: 1}"]
    ),
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=6,
)


@st.composite
def documents(draw):
    doc = {}
    for key in draw(st.lists(st.sampled_from(KEYS), max_size=6)):
        parts = key.split(".")
        node = doc
        for p in parts[:-1]:
            nxt = node.get(p)
            if not isinstance(nxt, dict):
                nxt = node[p] = {}
            node = nxt
        node[parts[-1]] = draw(VALUES)
    if draw(st.integers(0, 9)) == 0:
        doc = draw(VALUES)
    return doc


OVERRIDE = st.one_of(
    _plausible(),
    _plausible(),
    st.tuples(st.sampled_from(KEYS), SCALARS).map(
        lambda kv: f"{kv[0]}={yaml.safe_dump(kv[1]).strip()}".replace("\n...", "")
    ),
    st.tuples(st.sampled_from(KEYS), st.text(max_size=10)).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.text(max_size=20),
)
OVERRIDES = st.one_of(st.lists(OVERRIDE, min_size=1, max_size=1), st.lists(OVERRIDE, max_size=4))


def check_config(path, overrides) -> str:
    try:
        cfg = load_config(path, overrides)
    except ConfigError as e:
        assert str(e) and "\n" not in str(e)
        return "rejected"
    assert isinstance(cfg, RunConfig)
    floats = [v for s in cfg.to_dict().values() for v in _leaves(s) if isinstance(v, float)]
    assert all(np.isfinite(floats)), floats
    assert build_config(cfg.to_dict()) == cfg  # what validates also round-trips
    return "loaded"


def _leaves(x):
    if isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)
    else:
        yield x


def test_config_loader_on_any_yaml(scratch):
    @settings(max_examples=500, **FUZZ)
    @given(doc=documents())
    def one(counts, doc):
        path = scratch / "config.yaml"
        try:
            path.write_text(yaml.safe_dump(doc))
        except (yaml.YAMLError, UnicodeEncodeError):
            return  # not representable as YAML text
        outcome = check_config(str(path), [])
        counts[outcome] = counts.get(outcome, 0) + 1

    counts = run_counted(one)
    assert counts.get("loaded", 0) >= 25 and counts.get("rejected", 0) >= 100, counts


def test_config_loader_on_any_override(scratch):
    @settings(max_examples=500, **FUZZ)
    @given(overrides=OVERRIDES)
    def one(counts, overrides):
        outcome = check_config(None, overrides)
        counts[outcome] = counts.get(outcome, 0) + 1

    counts = run_counted(one)
    assert counts.get("loaded", 0) >= 50 and counts.get("rejected", 0) >= 100, counts


def test_config_loader_on_any_text(scratch):
    @settings(max_examples=300, **FUZZ)
    @given(text=st.one_of(st.text(max_size=200), st.binary(max_size=200).map(lambda b: b.decode("latin-1"))))
    def one(counts, text):
        path = scratch / "config.yaml"
        path.write_bytes(text.encode("utf-8", errors="surrogatepass"))
        outcome = check_config(str(path), [])
        counts[outcome] = counts.get(outcome, 0) + 1

    counts = run_counted(one)
    assert counts.get("rejected", 0) >= 100, counts
