"""Hidden-state store: the format of the Arrow IPC shards of target features and their manifests, and the
memory-mapped reader training uses (hidden_write.py writes a shard and its manifest, hidden_verify.py
checks one against it; the pipeline that fills the shards is precompute.py).

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
see hidden_write.tree_digest).
Files appear under their final name only when complete (written to a temporary sibling, then renamed).
"""

from __future__ import annotations

import dataclasses
import json
import mmap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from .errors import UserError
from .io import FP8 as FP8  # the storage dtype names, re-exported for the shard format's users
from .io import StorageDtype
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
        d = {
            "target": self.target,
            "target_layer_ids": list(self.target_layer_ids),
            "dtype": self.dtype.name,
            "hidden_size": self.hidden_size,
            "num_features": self.num_features,
        }
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
            "hidden_val)"
        )
