"""The whole MLPerf BERT dataset in one command: ``python -m data.prepare.mlperf_dataset``.

Writes the files of NVIDIA's ``prepare_data.sh`` (per-part files, the reference chop, varlength,
the reference shuffle, the eval pick) with the same contents under ``OUT/hdf5/``, checks them
against NVIDIA's checksums where published, in ``--workers`` processes, resumable (files are
published whole). The tree, the stages and their cost: docs/data.md#the-real-mlperf-dataset-step-by-step.
"""

from __future__ import annotations

import argparse
import array
import json
import os
import random
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from functools import partial
from pathlib import Path

import numpy as np

from common.errors import DataError, cli_main
from common.files import file_digest, is_temporary, publishing, publishing_dir, remove_tree, write_text
from data.hdf5io import FIXED_KEYS, READ_ROWS, inspect, open_hdf5, read_file, write_fixed_arrays, write_varlength
from data.prepare.convert import convert_file
from data.prepare.mlperf_reference import RefParams, RefTokenizer, RefVocab, prepare_file
from data.prepare.progress import Pool, cached
from data.prepare.verify import CHECKSUM_DIR, read_checksums, verify
from data.samples import SampleBlock, _offsets

SHUFFLE_SEED = 24  # the reference shuffle's fixed seed
EVAL_ALL, EVAL_FILE = "eval_all.hdf5", "part_eval_10k.hdf5"
MLPERF_PARAMS = RefParams()  # 512/76, 0.15, 0.1, dupe 10, seed 12345
STATE_FILE = ".mlperf_dataset.json"


@dataclass(frozen=True)
class Layout:
    """The paths of prepare_data.sh's tree under ``OUT/hdf5``."""

    root: Path
    shards: int

    @property
    def training(self) -> Path:
        return self.root / "training"

    def stage_dir(self, kind: str) -> Path:
        suffix = {"chop": "uncompressed", "varlength": "varlength", "shuffled": "varlength_shuffled"}[kind]
        return self.root / f"training-{self.shards}" / f"hdf5_{self.shards}_shards_{suffix}"

    def shard_names(self) -> list[str]:
        return [f"part_{i:05d}_of_{self.shards:05d}.hdf5" for i in range(self.shards)]


def _file_task(src_dst: tuple[str, str], vocab: str, params: RefParams) -> int:
    tok = cached(("reference tokenizer", vocab), lambda: RefTokenizer(RefVocab(vocab)))  # a key apart from shards'
    return prepare_file(*src_dst, tok.vocab, params, tok)


def prepare_files(
    inputs: list[Path], out_dir: Path, vocab: str, params: RefParams, pool: Pool, skip_existing: bool = True
) -> list[Path]:
    """Stage 1: ``out_dir/<input name>.hdf5``, the reference ``create_pretraining_data.py`` output of each
    input file (kept when already there and ``skip_existing``); returns those paths in input order."""
    RefVocab(vocab)  # fail early on a bad vocabulary
    outs = [out_dir / f"{f.name}.hdf5" for f in inputs]  # the reference's names
    if len({o.name for o in outs}) != len(outs):
        raise DataError(f"{out_dir}: two inputs have the same file name; their outputs would collide")
    todo = [(str(f), str(o)) for f, o in zip(inputs, outs) if not (skip_existing and o.exists())]
    todo.sort(key=lambda t: -os.path.getsize(t[0]))  # largest first: better balance across workers
    pool.map(partial(_file_task, vocab=vocab, params=params), todo, "per-file samples")
    return outs


def chop_sizes(total: int, shards: int) -> np.ndarray:
    """Samples per shard in the reference chop: ceil(total / shards), one fewer in the first
    (shards * ceil(total / shards) - total) shards (docs/data.md#how-it-matches-the-reference)."""
    if total < 2 * shards:
        raise DataError(f"{total} samples are too few for --shards {shards} (need at least {2 * shards})")
    nominal = -(-total // shards)
    excess = shards * nominal - total
    sizes = np.full(shards, nominal, np.int64)
    sizes[:excess] -= 1
    return sizes


@dataclass(frozen=True)
class _ChopTask:
    inputs: tuple[str, ...]
    input_offsets: tuple[int, ...]  # global index of each input's first sample (+ the total)
    lo: int
    hi: int
    dst: str


def _chop_task(t: _ChopTask) -> None:
    parts = {k: [] for k in FIXED_KEYS}
    for src, first, end in zip(t.inputs, t.input_offsets, t.input_offsets[1:]):
        a, b = max(t.lo, first) - first, min(t.hi, end) - first  # the rows of this file
        if a >= b:
            continue
        with open_hdf5(src) as f:
            inspect(src)  # its declared shapes against its size, before reading
            for k in FIXED_KEYS:
                parts[k] += [f[k][lo : min(lo + READ_ROWS, b)] for lo in range(a, b, READ_ROWS)]
    write_fixed_arrays(t.dst, {k: np.concatenate(v) for k, v in parts.items()})


def chop(files: list[Path], layout: Layout, pool: Pool) -> np.ndarray:
    """Stage 2: the reference chop of the per-part files (in name order); returns the shard sizes."""
    files = sorted(files, key=lambda p: p.name)
    counts = [inspect(f).num_samples for f in files]
    sizes = chop_sizes(sum(counts), layout.shards)
    in_off, out_off = _offsets(np.array(counts)), _offsets(sizes)
    out = layout.stage_dir("chop")
    tasks = []
    for j, name in enumerate(layout.shard_names()):
        if (out / name).exists():
            continue
        lo, hi = int(out_off[j]), int(out_off[j + 1])
        a = int(np.searchsorted(in_off, lo, side="right")) - 1  # the input files this shard's samples come from
        b = int(np.searchsorted(in_off, hi, side="left"))
        srcs = tuple(str(f) for f in files[a:b])
        tasks.append(_ChopTask(srcs, tuple(int(x) for x in in_off[a : b + 1]), lo, hi, str(out / name)))
    pool.map(_chop_task, tasks, "chop")
    return sizes


def _varlength_task(src_dst: tuple[str, str]) -> None:
    convert_file(*src_dst, "varlength")


def to_varlength(src_dir: Path, dst_dir: Path, names: list[str], pool: Pool, desc: str = "varlength") -> None:
    """Stage 3 (and the eval file's): the files ``names`` of ``src_dir`` in the varlength layout in ``dst_dir``."""
    todo = [(str(src_dir / n), str(dst_dir / n)) for n in names if not (dst_dir / n).exists()]
    pool.map(_varlength_task, todo, desc)


def shuffle_permutation(total: int, seed: int = SHUFFLE_SEED) -> np.ndarray:
    """out[p] = global index (shards in order, rows in order) of the sample that the reference
    shuffle of the (shard, index) pairs puts at output position p (docs/data.md#how-it-matches-the-reference)."""
    if total >= 2**31:
        raise DataError(f"{total} samples: the shuffle supports fewer than 2^31")
    idx = array.array("i", range(total))
    random.Random(seed).shuffle(idx)
    return np.frombuffer(idx, dtype=np.int32)  # a view: the array stays alive through it


_SCATTER_KEYS = ("pos", "tok_off", "m_off", "nsp", "tok", "seg", "mpos", "mids")


@dataclass(frozen=True)
class _ScatterTask:
    task: int
    inputs: tuple[str, ...]
    first_global: int  # global index of the first sample of inputs[0]
    inverse: str  # .npy: output position of each global index
    out_dir: str


def _scatter_task(t: _ScatterTask) -> None:
    """Write this group's samples sorted by output position, as flat .npy arrays."""
    block = SampleBlock.concat([read_file(p) for p in t.inputs])
    inv = np.load(t.inverse, mmap_mode="r")
    pos = np.asarray(inv[t.first_global : t.first_global + len(block)], dtype=np.int64)
    order = np.argsort(pos, kind="stable")
    b = block.select(order)
    arrays = {
        "pos": pos[order],
        "tok_off": _offsets(b.seq_lens),
        "m_off": _offsets(b.masked_counts),
        "nsp": b.nsp_labels,
        "tok": b.input_ids.astype(np.int16),
        "seg": b.segment_ids.astype(np.int8),
        "mpos": b.masked_positions.astype(np.int16),
        "mids": b.masked_ids.astype(np.int16),
    }
    final = Path(t.out_dir) / f"task_{t.task:05d}"
    with publishing_dir(final) as tmp:
        for k, v in arrays.items():
            np.save(tmp / f"{k}.npy", v)


@dataclass(frozen=True)
class _GatherTask:
    tasks: int
    scatter_dir: str
    bounds: tuple[int, ...]  # output positions where each output shard of this group starts, and its end
    dsts: tuple[str, ...]
    max_seq_length: int
    max_predictions: int


def _gather_task(t: _GatherTask) -> None:
    lo, hi = t.bounds[0], t.bounds[-1]
    pieces, pos = [], []
    for k in range(t.tasks):
        d = Path(t.scatter_dir) / f"task_{k:05d}"
        a = {key: np.load(d / f"{key}.npy", mmap_mode="r") for key in _SCATTER_KEYS}
        r0, r1 = (int(x) for x in np.searchsorted(a["pos"], [lo, hi]))
        if r0 == r1:
            continue
        t0, t1 = int(a["tok_off"][r0]), int(a["tok_off"][r1])
        m0, m1 = int(a["m_off"][r0]), int(a["m_off"][r1])
        pieces.append(
            SampleBlock(
                input_ids=np.array(a["tok"][t0:t1], np.int32),
                segment_ids=np.array(a["seg"][t0:t1], np.int8),
                seq_lens=np.diff(np.asarray(a["tok_off"][r0 : r1 + 1])).astype(np.int32),
                masked_positions=np.array(a["mpos"][m0:m1], np.int32),
                masked_ids=np.array(a["mids"][m0:m1], np.int32),
                masked_counts=np.diff(np.asarray(a["m_off"][r0 : r1 + 1])).astype(np.int32),
                nsp_labels=np.array(a["nsp"][r0:r1], np.int8),
            )
        )
        pos.append(np.array(a["pos"][r0:r1]))
        del a
    block = SampleBlock.concat(pieces)
    block = block.select(np.argsort(np.concatenate(pos), kind="stable"))
    if len(block) != hi - lo:
        raise DataError(f"{t.scatter_dir}: found {len(block)} samples for output positions {lo}..{hi - 1}")
    for dst, a, b in zip(t.dsts, t.bounds, t.bounds[1:]):
        if not Path(dst).exists():
            write_varlength(dst, block.select(np.arange(a - lo, b - lo)), t.max_seq_length, t.max_predictions)


def _groups(sizes: np.ndarray, rows: int) -> list[tuple[int, int]]:
    """Consecutive shard ranges [a, b) of about ``rows`` samples each (at least one shard)."""
    out, a, acc = [], 0, 0
    for j, s in enumerate(sizes):
        acc += int(s)
        if acc >= rows:
            out.append((a, j + 1))
            a, acc = j + 1, 0
    if a < len(sizes):
        out.append((a, len(sizes)))
    return out


def shuffle(
    layout: Layout, sizes: np.ndarray, max_seq_length: int, max_predictions: int, pool: Pool, group_rows: int, log
) -> None:
    """Stage 4: the reference shuffle of the varlength shards into the shuffled directory."""
    names = layout.shard_names()
    src, dst = layout.stage_dir("varlength"), layout.stage_dir("shuffled")
    work = layout.root / ".work" / f"shuffle-{layout.shards}"  # the shuffle's scratch files, removed when done
    if all((dst / n).exists() for n in names):
        shutil.rmtree(work, ignore_errors=True)
        return
    total = int(sizes.sum())
    work.mkdir(parents=True, exist_ok=True)
    inverse = work / "inverse.npy"
    if not inverse.exists():
        t = time.perf_counter()
        perm = shuffle_permutation(total)
        inv = np.empty(total, np.int32)
        for a in range(0, total, 1 << 24):  # in pieces: no third array of the full size
            b = min(a + (1 << 24), total)
            inv[perm[a:b]] = np.arange(a, b, dtype=np.int32)
        del perm
        with publishing(inverse) as tmp:
            np.save(tmp, inv)
        log(f"shuffle: permutation of {total} samples ({time.perf_counter() - t:.1f} s)")
    off = _offsets(sizes)
    groups = _groups(sizes, group_rows)
    scatter_dir = work / f"scatter-{group_rows}"  # a restart with other groups starts its own
    tasks = [
        _ScatterTask(k, tuple(str(src / names[j]) for j in range(a, b)), int(off[a]), str(inverse), str(scatter_dir))
        for k, (a, b) in enumerate(groups)
    ]
    pool.map(_scatter_task, [t for t in tasks if not (scatter_dir / f"task_{t.task:05d}").exists()], "shuffle: scatter")
    gathers = [
        _GatherTask(
            len(tasks),
            str(scatter_dir),
            tuple(int(x) for x in off[a : b + 1]),
            tuple(str(dst / names[j]) for j in range(a, b)),
            max_seq_length,
            max_predictions,
        )
        for a, b in groups
        if not all((dst / names[j]).exists() for j in range(a, b))
    ]
    dst.mkdir(parents=True, exist_ok=True)
    pool.map(_gather_task, gathers, "shuffle: gather")
    shutil.rmtree(work, ignore_errors=True)


def pick_eval(src: Path, dst: Path, num: int) -> None:
    """Stage 5: the reference eval pick, sample ``int(i * (n / num))`` for i < num (may repeat), fixed layout."""
    n = inspect(src).num_samples
    idx = np.array([int(i * (n / num)) for i in range(num)], np.int64)
    rows, back = np.unique(idx, return_inverse=True)
    arrays = {k: [] for k in FIXED_KEYS}
    with open_hdf5(src) as f:
        for a in range(0, n, READ_ROWS):  # READ_ROWS at a time: only the picked rows are kept
            pick = rows[(rows >= a) & (rows < a + READ_ROWS)] - a
            for k in FIXED_KEYS:
                arrays[k].append(f[k][a : a + READ_ROWS][pick])
    write_fixed_arrays(dst, {k: np.concatenate(v)[back] for k, v in arrays.items()})


@dataclass
class DatasetConfig:
    text_dir: str
    eval_text: str
    vocab: str
    output_dir: str
    shards: int
    params: RefParams = field(default_factory=RefParams)
    eval_samples: int = 10000
    workers: int = 1
    group_rows: int = 250_000  # samples a shuffle worker holds at once
    checksums: str | None = None  # a directory of checksum lists (default: the shipped ones)

    def __post_init__(self):
        for name in ("shards", "eval_samples", "workers", "group_rows"):
            if getattr(self, name) < 1:
                raise DataError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be >= 1")


def text_parts(text_dir: Path, eval_text: Path) -> list[Path]:
    """The ``part-*`` files of the text directory (not the eval text), sorted by name."""
    if not text_dir.is_dir():
        raise DataError(f"{text_dir}: no such directory")
    parts = sorted(  # iterdir: an unreadable directory is a PermissionError (glob would find nothing)
        p
        for p in text_dir.iterdir()
        if p.name.startswith("part-") and p.is_file() and p.resolve() != eval_text.resolve()
    )
    if not parts:
        raise DataError(f"{text_dir}: no part-* text files")
    return parts


def _check_state(root: Path, state: dict) -> None:
    """A restart must use the same inputs and parameters as the run it continues."""
    path = root / STATE_FILE
    if path.exists():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(state) if old.get(k) != state.get(k))
        if diff:
            raise DataError(f"{root}: holds a dataset made with other {', '.join(diff)}; use a new --output-dir")
        return
    root.mkdir(parents=True, exist_ok=True)
    write_text(path, json.dumps(state, indent=1, sort_keys=True) + "\n")


def _checks(cfg: DatasetConfig) -> list[tuple[str, Path]]:
    """(stage, checksum list) pairs to verify: every matching list in --checksums, or the shipped
    ones (NVIDIA's) when the parameters are MLPerf's, the eval list only for 10,000 eval samples."""
    if cfg.checksums is None and cfg.params != MLPERF_PARAMS:
        return []
    d = CHECKSUM_DIR if cfg.checksums is None else Path(cfg.checksums)
    if not d.is_dir():
        raise DataError(f"--checksums {d}: no such directory")
    cand = [
        ("varlength", d / f"{cfg.shards}_shards_varlength.chk"),
        ("shuffled", d / f"{cfg.shards}_shards_varlength_shuffled.chk"),
    ]
    if cfg.checksums is not None or cfg.eval_samples == 10000:
        cand.append(("eval", d / "eval_varlength.chk"))
    return [(w, p) for w, p in cand if p.is_file()]


def _remove_temporaries(root: Path) -> None:
    """What a killed run left under temporary names (never a finished file)."""
    for p in sorted(root.rglob("*.tmp*"), reverse=True):
        if is_temporary(p.name):
            remove_tree(p)


def build(cfg: DatasetConfig, log=print) -> dict:
    """Run (or resume) every stage; returns {stage: seconds} and the verification results."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    text_dir, eval_text = Path(cfg.text_dir), Path(cfg.eval_text)
    if not eval_text.is_file():
        raise DataError(f"{eval_text}: no such file")
    parts = text_parts(text_dir, eval_text)
    RefVocab(cfg.vocab)
    layout = Layout(Path(cfg.output_dir) / "hdf5", cfg.shards)
    _check_state(
        layout.root,
        {
            "params": asdict(cfg.params),
            "vocab_md5": file_digest(cfg.vocab),
            "inputs": [[p.name, p.stat().st_size] for p in parts],
            "eval_text": [eval_text.name, eval_text.stat().st_size],
            "eval_samples": cfg.eval_samples,
        },
    )
    _remove_temporaries(layout.root)
    seconds: dict[str, float] = {}
    t = time.perf_counter()

    def lap(stage: str) -> None:
        nonlocal t
        seconds[stage] = time.perf_counter() - t
        log(f"{stage}: done ({seconds[stage]:.1f} s)")
        t = time.perf_counter()

    with Pool(cfg.workers) as pool:
        files = prepare_files(parts, layout.training, cfg.vocab, cfg.params, pool)
        lap("per-file samples")
        sizes = chop(files, layout, pool)
        lap("chop")
        names = layout.shard_names()
        to_varlength(layout.stage_dir("chop"), layout.stage_dir("varlength"), names, pool)
        lap("varlength")
        shuffle(layout, sizes, cfg.params.max_seq_length, cfg.params.max_predictions, pool, cfg.group_rows, log)
        lap("shuffle")
        eval_dir = layout.root / "eval"
        if not (layout.root / "eval_varlength" / EVAL_FILE).exists():
            if not (eval_dir / EVAL_FILE).exists():
                if not (eval_dir / EVAL_ALL).exists():
                    prepare_file(eval_text, eval_dir / EVAL_ALL, RefVocab(cfg.vocab), cfg.params)
                pick_eval(eval_dir / EVAL_ALL, eval_dir / EVAL_FILE, cfg.eval_samples)
            to_varlength(eval_dir, layout.root / "eval_varlength", [EVAL_FILE], pool, "eval varlength")
        lap("eval")

    dirs = {k: layout.stage_dir(k) for k in ("varlength", "shuffled")} | {"eval": layout.root / "eval_varlength"}
    problems, verified = [], []
    for stage, chk in _checks(cfg):
        bad = verify([dirs[stage]], read_checksums(chk), cfg.workers, f"verify {stage}")
        problems += [f"{stage}: {p}" for p in bad]
        verified.append(str(chk))
    if verified:
        lap("verify")
    if problems:
        raise DataError(f"{len(problems)} file(s) differ from the published checksums:\n  " + "\n  ".join(problems))
    return {"seconds": seconds, "verified": verified, "samples": int(sizes.sum())}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m data.prepare.mlperf_dataset",
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    ap.add_argument("--text-dir", required=True, help="MLCommons' results4 folder (part-XXXXX-of-00500 files)")
    ap.add_argument("--eval-text", required=True, help="eval.txt")
    ap.add_argument("--vocab", required=True, help="the phase-1 vocab.txt")
    ap.add_argument("--output-dir", required=True, help="gets hdf5/ with prepare_data.sh's tree")
    ap.add_argument("--shards", type=int, required=True, help="training shards: 2048 or 4320 for MLPerf")
    ap.add_argument("--dupe-factor", type=int, default=MLPERF_PARAMS.dupe_factor)
    ap.add_argument("--max-seq-length", type=int, default=MLPERF_PARAMS.max_seq_length)
    ap.add_argument("--max-predictions", type=int, default=MLPERF_PARAMS.max_predictions)
    ap.add_argument("--seed", type=int, default=MLPERF_PARAMS.seed, help="create_pretraining_data's random_seed")
    ap.add_argument("--eval-samples", type=int, default=10000)
    ap.add_argument("--workers", type=int, default=1, help="processes")
    ap.add_argument(
        "--group-rows",
        type=int,
        default=250_000,
        help="samples a shuffle worker holds at once (about 1.5 kB each at 512/76)",
    )
    ap.add_argument(
        "--checksums",
        help="directory of checksum lists to verify against (default: the published "
        "ones shipped in data/prepare/checksums, when the shard count and parameters match)",
    )
    args = vars(ap.parse_args(argv))  # the flags are RefParams' and DatasetConfig's fields
    params = RefParams(**{k: args.pop(k) for k in ("max_seq_length", "max_predictions", "dupe_factor", "seed")})
    cfg = DatasetConfig(**args, params=params)
    start = time.perf_counter()
    result = build(cfg, log=lambda m: print(f"mlperf_dataset: {m}", file=sys.stderr, flush=True))
    names = ", ".join(Path(p).name for p in result["verified"])
    checked = f"; checked against {names}" if names else "; no published checksums for these parameters"
    print(
        f"wrote {result['samples']} training samples in {cfg.shards} shards under "
        f"{Path(cfg.output_dir) / 'hdf5'} ({time.perf_counter() - start:.1f} s){checked}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(cli_main(main))
