"""TensorFlow checkpoints read without TensorFlow (only ``google_crc32c``): MLPerf's phase-1 starting point.

``read_tf_checkpoint(prefix)`` decodes a TF V2 checkpoint (protobuf entries in a LevelDB table) into numpy
arrays; ``read_google_bert(prefix)`` reads Google BERT's weights under ``BertForPreTraining``'s names. The
format and its checks: [docs/training.md](../docs/training.md#initial-weights-mlperfs-phase-1-checkpoint).
"""

from __future__ import annotations

import os
import re
import struct

import numpy as np

from common.errors import CheckpointError
from common.files import UnsafeFile, open_checked, read_checked

# tensorflow/core/framework/types.proto: DataType -> numpy dtype (little-endian).
_DTYPES = {1: np.float32, 2: np.float64, 3: np.int32, 4: np.uint8, 5: np.int16, 6: np.int8, 9: np.int64}
_DTYPES.update({10: np.bool_, 17: np.uint16, 19: np.float16, 22: np.uint32, 23: np.uint64})
_DTYPE_NAMES = {7: "string", 14: "bfloat16", 8: "complex64", 18: "complex128"}
_TABLE_MAGIC = 0xDB4775248B80FB57
_FOOTER_SIZE = 48
_MASK_DELTA = 0xA282EAD8


def _crc32c(data: bytes | memoryview) -> int:
    import google_crc32c

    return google_crc32c.value(bytes(data))


def _unmask(masked: int) -> int:
    """LevelDB/TF store ``rotate_right(crc, 15) + delta``; undo it."""
    rot = (masked - _MASK_DELTA) & 0xFFFFFFFF
    return ((rot >> 17) | (rot << 15)) & 0xFFFFFFFF


def _varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise IndexError("varint runs past the end")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7
        if shift > 63:
            raise ValueError("varint longer than 10 bytes")


def _fields(buf: bytes | memoryview):
    """Yield (field number, wire type, value) of a protobuf message; value is an int for
    varint/fixed fields and bytes for length-delimited ones."""
    pos = 0
    while pos < len(buf):
        key, pos = _varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, pos = _varint(buf, pos)
        elif wire == 1:
            value = struct.unpack_from("<Q", buf, pos)[0]
            pos += 8
        elif wire == 2:
            n, pos = _varint(buf, pos)
            value = bytes(buf[pos : pos + n])
            if len(value) != n:
                raise ValueError("length-delimited field runs past the end")
            pos += n
        elif wire == 5:
            value = struct.unpack_from("<I", buf, pos)[0]
            pos += 4
        else:
            raise ValueError(f"unsupported wire type {wire}")
        yield number, wire, value


def _parse_entry(value: bytes) -> dict:
    """BundleEntryProto: dtype=1, shape=2, shard_id=3, offset=4, size=5, crc32c=6, slices=7."""
    entry = {"dtype": 0, "shape": [], "shard_id": 0, "offset": 0, "size": 0, "crc32c": None, "sliced": False}
    scalars = {1: "dtype", 3: "shard_id", 4: "offset", 5: "size", 6: "crc32c"}
    for number, _, v in _fields(value):
        if number in scalars:
            entry[scalars[number]] = v
        elif number == 2:  # TensorShapeProto: dim=2 {size=1, name=2}, unknown_rank=3
            for dn, _, dv in _fields(v):
                if dn == 2:
                    size = next((s for n, _, s in _fields(dv) if n == 1), 0)
                    entry["shape"].append(size - (1 << 64) if size >= 1 << 63 else size)
                elif dn == 3 and dv:
                    entry["shape"] = None
        elif number == 7:
            entry["sliced"] = True
    return entry


def _read_block(data: bytes, offset: int, size: int, path: str) -> memoryview:
    """A block's contents after checking its 5-byte trailer (compression type, masked CRC)."""
    end = offset + size
    if end + 5 > len(data):
        raise CheckpointError(f"{path}: truncated (a table block ends at byte {end + 5}, the file has {len(data)})")
    kind = data[end]
    stored = struct.unpack_from("<I", data, end + 1)[0]
    if _crc32c(memoryview(data)[offset : end + 1]) != _unmask(stored):
        raise CheckpointError(f"{path}: checksum mismatch in the table block at byte {offset}")
    if kind != 0:
        raise CheckpointError(
            f"{path}: table block at byte {offset} is compressed (type {kind}); "
            "TensorFlow writes checkpoint indexes uncompressed"
        )
    return memoryview(data)[offset:end]


def _block_entries(block: memoryview):
    """Yield (key, value) of a table block (prefix-compressed keys, restart array at the end)."""
    num_restarts = struct.unpack_from("<I", block, len(block) - 4)[0]
    limit = len(block) - 4 - 4 * num_restarts
    pos, key = 0, b""
    while pos < limit:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        length, pos = _varint(block, pos)
        key = key[:shared] + bytes(block[pos : pos + unshared])
        pos += unshared
        yield key, bytes(block[pos : pos + length])
        pos += length


def _read_index(path: str) -> dict[bytes, bytes]:
    try:
        data = read_checked(path, max_bytes=1 << 30, what="a TensorFlow checkpoint index")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file (a TensorFlow checkpoint PREFIX needs PREFIX.index)") from None
    except UnsafeFile as e:
        raise CheckpointError(str(e)) from e
    if len(data) < _FOOTER_SIZE:
        raise CheckpointError(f"{path}: truncated ({len(data)} bytes, shorter than the table footer)")
    footer = data[-_FOOTER_SIZE:]
    if struct.unpack_from("<Q", footer, 40)[0] != _TABLE_MAGIC:
        raise CheckpointError(f"{path}: not a TensorFlow checkpoint index (bad table magic number)")
    try:
        _, pos = _varint(footer, 0)  # metaindex handle: offset, size (unused)
        _, pos = _varint(footer, pos)
        index_offset, pos = _varint(footer, pos)
        index_size, _ = _varint(footer, pos)
        entries = {}
        for _, handle in _block_entries(_read_block(data, index_offset, index_size, path)):
            offset, p = _varint(handle, 0)
            size, _ = _varint(handle, p)
            entries.update(_block_entries(_read_block(data, offset, size, path)))
    except (IndexError, ValueError, struct.error) as e:
        raise CheckpointError(f"{path}: malformed table ({e})") from e
    return entries


def is_tf_checkpoint(path: str) -> bool:
    """True when ``path`` is a TensorFlow checkpoint prefix (``path.index`` exists)."""
    return os.path.isfile(path + ".index") and not os.path.isdir(path)


def read_tf_checkpoint(prefix: str, include=None) -> dict[str, np.ndarray]:
    """Every variable of the TF V2 checkpoint ``prefix`` by its TensorFlow name, bitwise, each checked
    against its CRC-32C; ``include(name) -> bool`` reads only some (the converter skips the optimizer slots)."""
    index_path = prefix + ".index"
    entries = _read_index(index_path)
    header = entries.pop(b"", None)
    if header is None:
        raise CheckpointError(f"{index_path}: no bundle header (not a TF V2 checkpoint index)")
    # BundleHeaderProto: num_shards=1, endianness=2 (0 little, 1 big); the last of a repeated field wins.
    values = {number: v for number, _, v in _fields(header)}
    num_shards = values.get(1, 1)
    if values.get(2, 0) != 0:
        raise CheckpointError(f"{index_path}: big-endian checkpoints are not supported")
    shards, out = {}, {}
    try:
        for raw_name, value in sorted(entries.items()):
            name = raw_name.decode("utf-8")
            if include is not None and not include(name):
                continue
            entry = _parse_entry(value)
            where = f"{prefix} variable {name!r}"
            if entry["sliced"]:
                raise CheckpointError(f"{where}: partitioned (sliced) variables are not supported")
            dtype = _DTYPES.get(entry["dtype"])
            if dtype is None:
                kind = _DTYPE_NAMES.get(entry["dtype"], f"DataType {entry['dtype']}")
                raise CheckpointError(f"{where}: dtype {kind} is not supported")
            if entry["shape"] is None or any(d < 0 for d in entry["shape"]):
                raise CheckpointError(f"{where}: unknown shape")
            shape = tuple(entry["shape"])
            expected = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
            if entry["size"] != expected:
                raise CheckpointError(
                    f"{where}: {entry['size']} bytes stored for shape {list(shape)} of {np.dtype(dtype).name}"
                )
            shard = entry["shard_id"]
            if shard not in shards:
                if shard >= num_shards:
                    raise CheckpointError(f"{where}: shard {shard}, but the header says {num_shards} shards")
                data_path = f"{prefix}.data-{shard:05d}-of-{num_shards:05d}"
                try:  # a FIFO or a device is refused at once (fileio.open_checked)
                    shards[shard] = open_checked(data_path, what="a TensorFlow data shard")
                except FileNotFoundError:
                    raise CheckpointError(f"{data_path}: missing data shard ({where} is stored there)") from None
                except UnsafeFile as e:
                    raise CheckpointError(str(e)) from e
            f = shards[shard]
            f.seek(entry["offset"])
            raw = f.read(entry["size"])
            if len(raw) != entry["size"]:
                raise CheckpointError(
                    f"{f.name}: truncated ({where} needs bytes {entry['offset']}..{entry['offset'] + entry['size']})"
                )
            if entry["crc32c"] is not None and _crc32c(raw) != _unmask(entry["crc32c"]):
                raise CheckpointError(f"{f.name}: checksum mismatch in {where}")
            out[name] = np.frombuffer(raw, dtype=dtype).reshape(shape).copy()
    except (IndexError, ValueError, struct.error) as e:
        raise CheckpointError(f"{index_path}: malformed entry ({e})") from e
    finally:
        for f in shards.values():
            f.close()
    return out


# Not weights: optimizer slots, step counters and loss-scaling state of the TF trainers
# (Google's, NVIDIA's with AMP).
_SKIP = re.compile(r"(/adam_[mv]$|/Momentum$|^global_step$|^(good|bad)_steps$|^loss_scale$|^current_loss_scale$)")
_LAYER = re.compile(r"^bert/encoder/layer_(\d+)/(.+)$")
_LEAVES = {"kernel": "weight", "bias": "bias", "gamma": "weight", "beta": "bias"}
_FIXED = {  # the names that are not a module path (slashes as dots) and a _LEAVES leaf
    "bert/embeddings/word_embeddings": "bert.embeddings.word_embeddings.weight",
    "bert/embeddings/position_embeddings": "bert.embeddings.position_embeddings.weight",
    "bert/embeddings/token_type_embeddings": "bert.embeddings.token_type_embeddings.weight",
    "cls/predictions/output_bias": "cls.predictions.bias",
    "cls/seq_relationship/output_weights": "cls.seq_relationship.weight",
    "cls/seq_relationship/output_bias": "cls.seq_relationship.bias",
}
# The modules with _LEAVES variables; in a layer, the path after bert/encoder/layer_N/.
_MODULES = set(
    "bert/embeddings/LayerNorm bert/pooler/dense cls/predictions/transform/dense"
    " cls/predictions/transform/LayerNorm".split()
)
_LAYER_MODULES = set(
    "attention/self/query attention/self/key attention/self/value attention/output/dense attention/output/LayerNorm"
    " intermediate/dense output/dense output/LayerNorm".split()
)


def read_google_bert(prefix: str) -> tuple[dict[str, np.ndarray], list[str]]:
    """(Google BERT's weights in the checkpoint ``prefix`` under ``BertForPreTraining.state_dict()`` names,
    the variables skipped; optimizer slots and counters are never read); an unknown ``bert/`` or ``cls/``
    name is an error (a different model): nothing keeps its initial value."""
    out, skipped, unknown = {}, [], []

    def wanted(name: str) -> bool:
        if _SKIP.search(name):
            skipped.append(name)
            return False
        return True

    for name, value in read_tf_checkpoint(prefix, include=wanted).items():
        if not name.startswith(("bert/", "cls/")):
            skipped.append(name)
            continue
        hf = _hf_name(name)
        if hf is None:
            unknown.append(name)
            continue
        out[hf] = value.T.copy() if name.endswith("/kernel") else value
    if unknown:
        raise CheckpointError(f"unknown BERT variables (not Google BERT's names?): {sorted(unknown)}")
    return out, sorted(skipped)


def _hf_name(name: str) -> str | None:
    if name in _FIXED:
        return _FIXED[name]
    path, _, leaf = name.rpartition("/")
    m = _LAYER.match(path)
    if leaf not in _LEAVES or not (m.group(2) in _LAYER_MODULES if m else path in _MODULES):
        return None
    path = f"bert.encoder.layer.{m.group(1)}.{m.group(2)}" if m else path
    return f"{path.replace('/', '.')}.{_LEAVES[leaf]}"
