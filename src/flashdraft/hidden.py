"""Hidden-state store: Arrow IPC shards of target features, their manifests, a memory-mapped reader and
verification (the pipeline that fills the shards is precompute.py).

A shard is one Arrow IPC file with one row per sample:
  id (string), input_ids (list<int32>), loss_mask (list<int8>), num_tokens (int32),
  hidden (large_binary: the [num_tokens, K*H] features row-major in the storage dtype; bf16 as raw bits),
  and for float8_e4m3 shards only, scale (large_binary: float32[num_tokens], one scale per token);
  then, in a shard made for a drafter family that trains on it (`last_hidden` in the metadata, see
  families.py), last_hidden (large_binary: the [num_tokens, H] last hidden state of the target, after its
  final norm: what its LM head reads, in the same storage dtype) and for float8_e4m3 last_scale
  (large_binary: float32[num_tokens], its own scale per token: the final-norm state's range is far from
  the mid-layer features').
FP8 shards store e4m3 values x / scale with scale = amax(|x|) / 448 per token (the row of K*H features;
the row of H for last_hidden); the reader dequantizes them to bf16. bf16 and fp32 shards have no scale
column and are unchanged, so the format stays version 1: the schema that goes with a dtype (and
last_hidden) is fixed, and readers that predate fp8 reject such shards by their dtype. The schema metadata
names the format, dtype, K, H, the target and its layer ids (and `last_hidden: true` only for a shard that
has the column: one without the key has none, so a shard without it is written as before the key
existed), so a shard describes itself; the manifest next to it (`shard-00000.arrow` ->
`shard-00000.json`) adds counts and a checksum (`sha256_tree`: sha256 over the digests of 64 MiB chunks,
see tree_digest).
Files appear under their final name only when complete (written to a temporary sibling, then renamed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import mmap
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from .errors import UserError
from .io import FP8 as FP8  # the storage dtype names, re-exported for the shard format's users
from .io import StorageDtype, atomic_path, log, write_json
from .io import bytes_per_token as bytes_per_token

FORMAT = "flashdraft.hidden/1"
FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448


def storage_dtype(name: str | StorageDtype) -> torch.dtype:
    return StorageDtype.of(name).torch_dtype


def hidden_bytes(tokens: int, meta: ShardMeta) -> int:
    """The estimate of a shard's bytes (or a whole run's): the precompute preflight's, as the plan's."""
    return tokens * meta.token_bytes


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token e4m3: x [..., W] -> (x / scale as float8_e4m3fn, float32 scale [...]), on x's device."""
    x = x.float()
    amax = x.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, 1.0)  # an all-zero token keeps scale 1, never 0
    # clamp: x / scale may round just past 448, which e4m3fn (no Inf) would turn into NaN
    q = (x / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, rows: int = 64) -> torch.Tensor:
    """bf16 of q * scale per token, a few tokens at a time so the float32 temporary stays in cache: the
    same bits as one whole-tensor expression, at a higher rate on one CPU core (the reader's workers)."""
    out = torch.empty(q.shape, dtype=torch.bfloat16, device=q.device)
    for i in range(0, q.shape[0], rows):
        out[i : i + rows].copy_(q[i : i + rows].float().mul_(scale[i : i + rows].unsqueeze(-1)))
    return out


@dataclass
class ShardMeta:
    """What a shard holds: the target it came from, the decoder layers whose features it concatenates,
    the storage dtype, H, and whether it also holds the target's last hidden state (the `last_hidden`
    column). The field names are the keys on disk, in the schema metadata (`flashdraft.<key>`) and in the
    manifest, which adds `num_features` (K, derived here); `last_hidden` is on disk only when true (absent
    reads as false). `dtype` is given by its name (or parsed) and held parsed; on disk it is its name."""

    target: str
    target_layer_ids: list[int]
    dtype: StorageDtype
    hidden_size: int
    last_hidden: bool = False

    def __post_init__(self):
        self.target = str(self.target)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.dtype = StorageDtype.of(self.dtype)
        self.hidden_size = int(self.hidden_size)
        if not isinstance(self.last_hidden, bool):
            raise ValueError(f"last_hidden {self.last_hidden!r} is not a bool")

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    @property
    def width(self) -> int:
        """K*H: the features of one token."""
        return self.num_features * self.hidden_size

    @property
    def token_bytes(self) -> int:
        """Bytes one token takes in the shard (io.bytes_per_token)."""
        return self.dtype.bytes_per_token(self.num_features, self.hidden_size, self.last_hidden)

    def to_dict(self) -> dict:
        """The manifest's keys for it; `last_hidden` only when true, so a shard without the column (and its
        manifest) is written byte for byte as before the key existed."""
        d = {"target": self.target, "target_layer_ids": list(self.target_layer_ids),
             "dtype": self.dtype.name, "hidden_size": self.hidden_size, "num_features": self.num_features}
        return {**d, "last_hidden": True} if self.last_hidden else d

    def compared(self) -> dict:
        """What a reader compares between shards, and verify between a shard and its manifest: to_dict
        with `last_hidden` always there."""
        return {**self.to_dict(), "last_hidden": self.last_hidden}

    @classmethod
    def from_dict(cls, d: dict) -> ShardMeta:
        """From a manifest (or any dict with the fields; no `last_hidden`: false); a `num_features` that
        disagrees is an error."""
        names = [f.name for f in dataclasses.fields(cls) if f.name != "last_hidden"]
        meta = cls(**{k: d[k] for k in names}, last_hidden=d.get("last_hidden", False))
        if "num_features" in d and int(d["num_features"]) != meta.num_features:
            raise ValueError(f"num_features {d['num_features']} but {meta.num_features} target_layer_ids")
        return meta

    def schema_metadata(self) -> dict[str, str]:
        """The Arrow schema metadata: `flashdraft.<key>` -> the value as text (JSON for the layer ids)."""
        meta = {"format": FORMAT, **self.to_dict()}
        return {f"flashdraft.{k}": v if isinstance(v, str) else json.dumps(v) for k, v in meta.items()}

    @classmethod
    def from_schema_metadata(cls, metadata: dict[bytes, bytes] | None, path) -> ShardMeta:
        raw = {k.decode(): v.decode() for k, v in (metadata or {}).items()}
        if raw.get("flashdraft.format") != FORMAT:
            raise ValueError(f"{path}: not a {FORMAT} shard (format {raw.get('flashdraft.format')!r})")
        fields = {
            "target": raw["flashdraft.target"],
            "target_layer_ids": json.loads(raw["flashdraft.target_layer_ids"]),
            "dtype": StorageDtype.of(raw["flashdraft.dtype"]),
            "hidden_size": int(raw["flashdraft.hidden_size"]),
            "num_features": int(raw["flashdraft.num_features"]),
            "last_hidden": json.loads(raw.get("flashdraft.last_hidden", "false")),
        }
        try:
            return cls.from_dict(fields)
        except ValueError as e:
            raise ValueError(f"{path}: schema metadata {e}") from e


def manifest_path(arrow_path) -> Path:
    """The manifest of a shard: `shard-00000.arrow` -> `shard-00000.json`."""
    return Path(arrow_path).with_suffix(".json")


def shard_schema(meta: ShardMeta) -> pa.Schema:
    fields = [
        ("id", pa.string()),
        ("input_ids", pa.list_(pa.int32())),
        ("loss_mask", pa.list_(pa.int8())),
        ("num_tokens", pa.int32()),
        ("hidden", pa.large_binary()),
    ]
    fields += [(name, pa.large_binary()) for name in binary_columns(meta)[1:]]
    return pa.schema(fields, metadata=meta.schema_metadata())


def binary_columns(meta: ShardMeta) -> list[str]:
    """A shard's large_binary columns, in schema order: hidden, then scale (fp8), last_hidden and
    last_scale (fp8) when it holds the target's last hidden state."""
    fp8 = meta.dtype.quantized
    return ["hidden"] + ["scale"] * fp8 + (["last_hidden"] + ["last_scale"] * fp8) * meta.last_hidden


def read_meta(schema: pa.Schema, path) -> ShardMeta:
    """Check a shard's schema and decode its metadata (target, layer ids, dtype, H, K)."""
    meta = ShardMeta.from_schema_metadata(schema.metadata, path)
    expected = shard_schema(meta)
    if not schema.equals(expected, check_metadata=False):
        got, want = schema.remove_metadata(), expected.remove_metadata()
        raise ValueError(f"{path}: schema {got} differs from {want}")
    return meta


# ---------------------------------------------------------------------------------------------- writing


CHECKSUM_CHUNK = 64 << 20  # bytes per hashed chunk of a shard file


def _sha256(pieces) -> bytes:
    h = hashlib.sha256()
    for piece in pieces:
        h.update(piece)
    return h.digest()


def tree_digest(chunk_digests) -> str:
    """A shard's checksum: sha256 of the concatenated sha256 digests of its consecutive 64 MiB chunks.

    Chunks hash independently, so writing and verifying hash on several cores: one sha256 stream is slower
    than a disk and far slower than the page cache."""
    return hashlib.sha256(b"".join(chunk_digests)).hexdigest()


def file_checksum(path, threads: int | None = None) -> str:
    """`tree_digest` of a file, its chunks read and hashed on a thread pool."""
    size = Path(path).stat().st_size
    fd = os.open(path, os.O_RDONLY)
    try:
        def chunk(i):
            return hashlib.sha256(os.pread(fd, CHECKSUM_CHUNK, i * CHECKSUM_CHUNK)).digest()

        with ThreadPoolExecutor(threads or min(8, os.cpu_count() or 1)) as pool:
            return tree_digest(pool.map(chunk, range(-(-size // CHECKSUM_CHUNK))))
    finally:
        os.close(fd)


class _HashingSink:
    """File sink that checksums what it writes (see `tree_digest`), so the manifest's checksum costs no
    second read of the shard. Full chunks hash on a small thread pool, in parallel with each other and
    with the writes (hashlib and file writes release the GIL), so hashing never caps the write rate."""

    def __init__(self, path, threads: int = 4):
        self.file, self.closed, self.threads = open(path, "wb"), False, threads
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="hidden-sha256")
        self.futures, self.waited = [], 0  # one digest per chunk, in file order
        self.pieces, self.fill = [], 0  # the chunk being filled: views of buffers Arrow has written
        self.checksum = None

    def write(self, data):
        n = self.file.write(data)
        view = memoryview(data).cast("B")
        while view.nbytes:
            take = min(CHECKSUM_CHUNK - self.fill, view.nbytes)
            self.pieces.append(view[:take])
            self.fill, view = self.fill + take, view[take:]
            if self.fill == CHECKSUM_CHUNK:
                self._submit()
        return n

    def _submit(self):
        self.futures.append(self.pool.submit(_sha256, self.pieces))
        self.pieces, self.fill = [], 0
        while len(self.futures) - self.waited > 2 * self.threads:  # bound the buffers held for hashing
            self.futures[self.waited].result()
            self.waited += 1

    def tell(self):
        return self.file.tell()

    def flush(self):
        self.file.flush()

    def close(self):
        if self.pieces:
            self._submit()
        try:
            self.checksum = tree_digest([f.result() for f in self.futures])
        finally:
            self.pool.shutdown()
            self.file.close()
            self.closed = True


class ShardWriter:
    """Appends rows to one Arrow IPC file, a few rows per record batch so memory stays bounded.

    Use it through `open_shard`, which writes a temporary sibling and renames it only on success."""

    def __init__(self, path, meta: ShardMeta, *, max_rows=8, max_bytes=256 << 20):
        self.torch_dtype = meta.dtype.torch_dtype
        self.meta, self.width = meta, meta.width
        self.columns = binary_columns(meta)
        self.schema = shard_schema(meta)
        self.sink = _HashingSink(path)
        self.writer = ipc.new_file(pa.PythonFile(self.sink, mode="w"), self.schema)
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self.pending, self.pending_bytes = [], 0
        self.rows = self.tokens = self.bytes = 0
        self.checksum = None
        self.timing = None  # set by write_shard

    def _check(self, sample_id, n: int, mask_len: int, got, want) -> None:
        if n == 0 or mask_len != n or got != want:
            raise ValueError(
                f"row {sample_id!r}: {n} input ids, {mask_len} mask values, (shape, dtype) of {got}; "
                f"expected a non-empty row with {want}"
            )

    def _want(self, n: int) -> dict:
        """(shape, dtype) of each binary column of n tokens."""
        shapes = {"hidden": (n, self.width), "scale": (n,), "last_hidden": (n, self.meta.hidden_size),
                  "last_scale": (n,)}
        return {k: (shapes[k], self.torch_dtype if "hidden" in k else torch.float32) for k in self.columns}

    def _raws(self, sample_id, n: int, mask_len: int, tensors: dict) -> list[np.ndarray]:
        """The given binary columns' bytes, in schema order, once they are what the shard holds."""
        got = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items() if t is not None}
        self._check(sample_id, n, mask_len, got, self._want(n))
        return [_raw(tensors[k]) for k in self.columns]

    def write(self, sample_id: str, input_ids, loss_mask, hidden: torch.Tensor, scale=None, last_hidden=None,
              last_scale=None) -> None:
        """One row; fp8 shards take the quantized hidden with its float32 scale [n] (see quantize_fp8); a
        shard with `meta.last_hidden` takes the target's last hidden state [n, H] too (fp8: quantized on its
        own, with its own last_scale [n])."""
        n = len(input_ids)
        tensors = {"hidden": hidden, "scale": scale, "last_hidden": last_hidden, "last_scale": last_scale}
        raws = self._raws(sample_id, n, len(loss_mask), tensors)
        self.pending.append((str(sample_id), list(input_ids), list(loss_mask), raws))
        self.pending_bytes += sum(r.size for r in raws)
        self.rows, self.tokens = self.rows + 1, self.tokens + n
        if len(self.pending) >= self.max_rows or self.pending_bytes >= self.max_bytes:
            self.flush()

    def write_rows(self, rows, hidden: torch.Tensor, scale=None, last_hidden=None, last_scale=None) -> None:
        """Rows (id, input_ids, loss_mask) whose features lie back to back in `hidden` [T, W] (and fp8
        `scale` [T]; the last hidden state [T, H] and its fp8 scale when the shard holds it), as one record
        batch that points at the tensors' memory: no copy before the file."""
        self.flush()
        lengths = [len(r[1]) for r in rows]
        total = sum(lengths)
        for sid, ids, mask in rows:
            self._check(sid, len(ids), len(mask), None, None)
        first_last = f"{rows[0][0]}..{rows[-1][0]}"
        tensors = {"hidden": hidden, "scale": scale, "last_hidden": last_hidden, "last_scale": last_scale}
        raws = self._raws(first_last, total, total, tensors)
        ids, input_ids, masks = zip(*((str(a), list(b), list(c)) for a, b, c in rows), strict=True)
        binaries = [_binary(r, [n * (r.size // total) for n in lengths]) for r in raws]  # bytes per token
        self._write_batch(ids, input_ids, masks, binaries)
        self.rows, self.tokens = self.rows + len(rows), self.tokens + total

    def flush(self) -> None:
        if not self.pending:
            return
        ids, input_ids, masks, raws = zip(*self.pending, strict=True)
        # each binary column (hidden, scale, ...): one copy into a contiguous buffer
        binaries = [_binary(np.concatenate(col), [r.size for r in col]) for col in zip(*raws, strict=True)]
        self._write_batch(ids, input_ids, masks, binaries)
        self.pending, self.pending_bytes = [], 0

    def _write_batch(self, ids, input_ids, masks, binaries) -> None:
        columns = [
            pa.array(ids, pa.string()),
            pa.array(input_ids, pa.list_(pa.int32())),
            pa.array(masks, pa.list_(pa.int8())),
            pa.array([len(x) for x in input_ids], pa.int32()),
            *binaries,  # hidden (scale, last_hidden, last_scale)
        ]
        self.writer.write_batch(pa.record_batch(columns, schema=self.schema))

    def close(self) -> None:
        self.flush()
        self.writer.close()
        self.bytes = self.sink.tell()
        self.sink.close()  # waits for the hash threads
        self.checksum = self.sink.checksum

    def abort(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()
        self.sink.close()


def _raw(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().contiguous().view(torch.uint8).numpy().reshape(-1)


def _binary(data: np.ndarray, sizes: list[int]) -> pa.LargeBinaryArray:
    """Rows of `sizes` bytes back to back in `data`, as a binary column over data's own memory. Sizes are
    multiples of the itemsize, so rows stay aligned."""
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    buffers = [None, pa.py_buffer(offsets), pa.py_buffer(data)]
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), len(sizes), buffers)


@contextlib.contextmanager
def open_shard(path, meta: ShardMeta, **writer_kw):
    """Yield a ShardWriter; the shard appears at `path` only if the block completes without error.

    A killed run leaves its temporary behind (nothing runs after kill -9); the rerun deletes it."""
    path = Path(path)
    for stale in path.parent.glob(f".tmp-*-{path.name}"):
        stale.unlink(missing_ok=True)
    with atomic_path(path) as tmp:
        writer = ShardWriter(tmp, meta, **writer_kw)
        try:
            yield writer
            writer.close()
        except BaseException as error:
            try:
                writer.abort()  # release the file so atomic_path can remove the temporary
            except Exception as second:  # the first error is the cause: raise it, not this one chained on it
                log(f"hidden shard {path}: while aborting after {error!r}, also: {second!r}")
            raise


def write_manifest(path, writer: ShardWriter, **extra) -> dict:
    """Manifest of a closed shard: what it holds, its size and checksum (+ `extra`: shard, counts, ...)."""
    manifest = {
        "format": FORMAT,
        **writer.meta.to_dict(),
        "rows": writer.rows,
        "tokens": writer.tokens,
        "bytes": writer.bytes,
        "sha256_tree": writer.checksum,  # see tree_digest
        "checksum_chunk_bytes": CHECKSUM_CHUNK,
        **extra,
    }
    write_json(path, manifest)
    return manifest


# ---------------------------------------------------------------------------------------------- reading


def int_values(arr: pa.Array) -> np.ndarray:
    """A null-free integer array's values as a read-only view of its buffer, as to_numpy() gives them:
    pyarrow's to_numpy imports pandas, a few tenths of a second of every training process's start."""
    if not pa.types.is_integer(arr.type) or arr.null_count:
        raise TypeError(f"int_values: {arr.type} with {arr.null_count} nulls")
    dtype = np.dtype(f"{'i' if pa.types.is_signed_integer(arr.type) else 'u'}{arr.type.bit_width // 8}")
    if len(arr) == 0:
        return np.zeros(0, dtype)
    return np.frombuffer(arr.buffers()[1], dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


class HiddenStore:
    """Memory-mapped, zero-copy view over shards; item i is one sample (global index across shards).

    fp8 shards are read zero-copy too, then dequantized to a new bf16 tensor per item.
    Files are mapped copy-on-write: hidden tensors alias the page cache, and an in-place op on one
    changes only this process's copy of those pages, never the shard (a read-only map would segfault)."""

    def __init__(self, paths):
        self.paths = [str(paths)] if isinstance(paths, (str, Path)) else [str(p) for p in paths]
        if not self.paths:
            raise ValueError("HiddenStore needs at least one shard")
        self.meta, self._maps, self._batches, locs, lengths = None, [], [], [], []
        for s, path in enumerate(self.paths):
            with open(path, "rb") as f:
                mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
            base = pa.py_buffer(mapped)
            reader = ipc.open_file(pa.BufferReader(base))
            meta = read_meta(reader.schema, path)
            if self.meta is None:
                self.meta = meta
            mine, first = meta.compared(), self.meta.compared()  # with and without last_hidden: an error
            diff = [k for k in first if mine[k] != first[k]]
            if diff:
                got = ", ".join(f"{k}={mine[k]!r}" for k in diff)
                want = ", ".join(f"{k}={first[k]!r}" for k in diff)
                raise ValueError(f"shard {path} has {got} but {self.paths[0]} has {want}: shards differ")
            batches = [reader.get_batch(b) for b in range(reader.num_record_batches)]
            for b, batch in enumerate(batches):
                n = int_values(batch.column("num_tokens"))
                lengths.append(n)
                locs += [(s, b, r) for r in range(len(n))]
            self._maps.append((mapped, base.address))
            self._batches.append(batches)
        self.lengths = np.concatenate(lengths).astype(np.int64) if lengths else np.zeros(0, np.int64)
        self._locs = locs
        self._dtype = self.meta.dtype.torch_dtype

    def __reduce__(self):
        return HiddenStore, (self.paths,)  # DataLoader workers reopen the maps instead of pickling them

    def __len__(self) -> int:
        return len(self._locs)

    def num_tokens(self, i: int) -> int:
        return int(self.lengths[i])

    def ids(self) -> list[str]:
        """Every sample's id, in index order."""
        return [sid for batches in self._batches for b in batches for sid in b.column("id").to_pylist()]

    def stored(self, i: int, name: str = "hidden") -> torch.Tensor:
        """Sample i's `name` column (hidden, last_hidden, or an fp8 shard's scale, last_scale) flat as the
        file stores it, before any dequantizing: a view over the mapped file."""
        s, b, r = self._locs[range(len(self))[i]]
        dtype = self._dtype if name in ("hidden", "last_hidden") else torch.float32
        return self._column(s, self._batches[s][b], r, name, dtype)

    def _column(self, s: int, batch, r: int, name: str, dtype: torch.dtype) -> torch.Tensor:
        """Row r of a large_binary column as a tensor over the mapped file (no copy)."""
        col = batch.column(name)
        _, offsets, data = col.buffers()
        start, end = np.frombuffer(offsets, np.int64)[col.offset + r : col.offset + r + 2]
        mapped, base = self._maps[s]
        count, offset = (end - start) // dtype.itemsize, data.address - base + start
        return torch.frombuffer(mapped, dtype=dtype, count=count, offset=offset)

    def __getitem__(self, i: int) -> dict:
        s, b, r = self._locs[range(len(self))[i]]  # range() handles negative indices and bounds
        batch = self._batches[s][b]
        n = int(batch.column("num_tokens")[r].as_py())
        item = {
            "id": batch.column("id")[r].as_py(),
            "input_ids": torch.tensor(int_values(batch.column("input_ids")[r].values), dtype=torch.long),
            "loss_mask": torch.tensor(int_values(batch.column("loss_mask")[r].values), dtype=torch.long),
            "hidden": self._values(s, batch, r, n, "hidden", "scale"),
        }
        if self.meta.last_hidden:
            item["last_hidden"] = self._values(s, batch, r, n, "last_hidden", "last_scale")
        return item

    def _values(self, s: int, batch, r: int, n: int, name: str, scale: str) -> torch.Tensor:
        """Row r of `name` as [n, -1]: a view over the mapped file, or fp8 dequantized by `scale` to bf16."""
        x = self._column(s, batch, r, name, self._dtype).view(n, -1)
        if self.meta.dtype.quantized:
            x = dequantize_fp8(x, self._column(s, batch, r, scale, torch.float32))
        return x

    @property
    def hidden_size(self) -> int:
        return self.meta.hidden_size

    @property
    def num_features(self) -> int:
        return self.meta.num_features

    @property
    def last_hidden(self) -> bool:
        """Whether its items carry `last_hidden` (the target's last hidden state [n, H])."""
        return self.meta.last_hidden

    @property
    def dtype(self) -> str:
        return self.meta.dtype.name

    @property
    def layer_ids(self) -> list[int]:
        return list(self.meta.target_layer_ids)

    @property
    def target(self) -> str:
        return self.meta.target


class StoreView:
    """Samples of a store under other numbers: view[i] is store[index[i]]. `index` a list (some samples,
    renumbered 0..n-1 in its order: the validation split) or a dict (a stream chunk's shards under the
    run's sample numbers). Picklable, for the loader's worker processes."""

    def __init__(self, store, index):
        self.store, self.index = store, index

    def __getitem__(self, i: int) -> dict:
        return self.store[self.index[i]]

    def __len__(self) -> int:
        return len(self.index)

    def num_tokens(self, i: int) -> int:
        return self.store.num_tokens(self.index[i])

    def ids(self) -> list[str]:
        ids = self.store.ids()
        order = sorted(self.index) if isinstance(self.index, dict) else range(len(self.index))
        return [ids[self.index[i]] for i in order]

    def __getattr__(self, name):  # the shards' metadata: layer_ids, hidden_size, dtype, ...
        if name in ("store", "index"):  # not yet set (unpickling)
            raise AttributeError(name)
        return getattr(self.store, name)


def require_last_hidden(store, family: str) -> None:
    """For a drafter family that trains on the target's last hidden state: one line naming the shard and
    drafter.family when the store (or view) was made without it."""
    if not store.meta.last_hidden:
        raise UserError(
            f"hidden shard {store.paths[0]} has no last_hidden column (the target's last hidden state), "
            f"which drafter.family {family} trains on: it was made for a family that does not store it; "
            "rerun the hidden stage (snakemake --forcerun hidden_shard; in stream mode hidden_chunk "
            "hidden_val)")


# --------------------------------------------------------------------------------------------- verifying


def _sizes(batch, name: str) -> np.ndarray:
    """Bytes per row of a large_binary column, from its offsets."""
    col = batch.column(name)
    return np.diff(np.frombuffer(col.buffers()[1], np.int64)[col.offset : col.offset + len(batch) + 1])


def verify_shard(arrow_path, manifest_file=None, max_errors=20) -> dict:
    """Check a shard against its manifest and itself; every error names the shard (and the row)."""
    arrow_path = Path(arrow_path)
    manifest_file = Path(manifest_file) if manifest_file else manifest_path(arrow_path)
    errors = []
    result = {"shard": str(arrow_path), "ok": False, "errors": errors}

    def err(msg):
        errors.append(f"{arrow_path}: {msg}")

    for p in (arrow_path, manifest_file):
        if not p.exists():
            err(f"missing file {p}")
    if errors:
        return result
    try:
        manifest = json.loads(manifest_file.read_text())
    except ValueError as e:
        err(f"manifest {manifest_file} is not valid JSON: {e}")
        return result
    if not isinstance(manifest, dict):
        err(f"manifest {manifest_file} holds {type(manifest).__name__}, not a JSON object")
        return result
    if manifest.get("format") != FORMAT:
        err(f"manifest format {manifest.get('format')!r}, expected {FORMAT!r}")
    size = arrow_path.stat().st_size
    if size != manifest.get("bytes"):
        err(f"file has {size} bytes, manifest says {manifest.get('bytes')}")
    if manifest.get("checksum_chunk_bytes") != CHECKSUM_CHUNK:
        got = manifest.get("checksum_chunk_bytes")
        err(f"manifest checksum_chunk_bytes {got}, expected {CHECKSUM_CHUNK}")
    digest = file_checksum(arrow_path)
    if digest != manifest.get("sha256_tree"):
        err(f"checksum (sha256_tree) {digest} does not match the manifest's {manifest.get('sha256_tree')}")
    try:
        store = HiddenStore([arrow_path])
    except (pa.ArrowException, OSError, ValueError, KeyError) as e:
        err(f"cannot be read as a hidden shard: {e}")
        return result
    listed = {**manifest, "last_hidden": manifest.get("last_hidden", False)}  # absent: a shard without it
    for k, v in store.meta.compared().items():
        if v != listed.get(k):
            err(f"schema metadata {k}={v!r} but manifest says {listed.get(k)!r}")
    if len(store) != manifest.get("rows"):
        err(f"{len(store)} rows, manifest says {manifest.get('rows')}")
    if int(store.lengths.sum()) != manifest.get("tokens"):
        err(f"{int(store.lengths.sum())} tokens, manifest says {manifest.get('tokens')}")

    meta = store.meta
    fp8, itemsize = meta.dtype.quantized, meta.dtype.itemsize
    # (values column, its fp8 scale column, values per token)
    checked = [("hidden", "scale", meta.width)]
    checked += [("last_hidden", "last_scale", meta.hidden_size)] * meta.last_hidden
    row, bad_rows = 0, 0
    for batch in store._batches[0]:
        ids = batch.column("id")
        sizes = {name: _sizes(batch, name) for name in binary_columns(meta)}
        for r in range(len(batch)):
            n = batch.column("num_tokens")[r].as_py()
            problems = []
            lens = (len(batch.column("input_ids")[r]), len(batch.column("loss_mask")[r]))
            if lens != (n, n):
                problems.append(f"{lens[0]} input ids and {lens[1]} mask values for num_tokens={n}")
            for name, scale_name, width in checked:
                sized = sizes[name][r] == n * width * itemsize
                if not sized:
                    problems.append(f"{name} has {sizes[name][r]} bytes, expected {n} x {width * itemsize}")
                if fp8 and sizes[scale_name][r] != n * 4:
                    sized = False
                    problems.append(f"{scale_name} has {sizes[scale_name][r]} bytes, expected {n} x 4")
                elif fp8 and sized:
                    scale = store._column(0, batch, r, scale_name, torch.float32)
                    if not (torch.isfinite(scale) & (scale > 0)).all():
                        problems.append(f"{scale_name} has values that are not finite and > 0")
                if sized and not torch.isfinite(store._values(0, batch, r, n, name, scale_name)).all():
                    problems.append(f"{name} has NaN or Inf values")
            if problems:
                bad_rows += 1
                if bad_rows <= max_errors:
                    err(f"row {row} (id {ids[r].as_py()!r}): " + "; ".join(problems))
            row += 1
    if bad_rows > max_errors:
        err(f"{bad_rows - max_errors} more bad rows not listed")
    result["ok"] = not errors
    return result


def move_aside(arrow_path, bad_dir=None) -> list[tuple[str, str]]:
    """Move a shard and its manifest into `bad_dir` (default: `bad/` next to the shard) as
    `<name>.<UTC time>.arrow` and `.json`, out of the way of a rebuild but kept for inspection.
    Returns the (from, to) pairs of the files that existed."""
    arrow_path = Path(arrow_path)
    bad_dir = Path(bad_dir) if bad_dir else arrow_path.parent / "bad"
    bad_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    stem, n = f"{arrow_path.stem}.{stamp}", 1
    while any((bad_dir / f"{stem}{ext}").exists() for ext in (".arrow", ".json")):  # same second
        stem, n = f"{arrow_path.stem}.{stamp}-{n}", n + 1
    moved = []
    for src in (arrow_path, manifest_path(arrow_path)):
        if src.exists():
            dst = bad_dir / f"{stem}{src.suffix}"
            os.replace(src, dst)
            moved.append((str(src), str(dst)))
    return moved
