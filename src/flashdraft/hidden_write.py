"""Writing hidden-state shards (the format is hidden.py's): `open_shard` yields a `ShardWriter` whose shard
appears under its final name only once complete, `write_manifest` the manifest next to it, and the
shard's checksum (`tree_digest`: sha256 over the digests of its 64 MiB chunks), hashed as the file is
written and recomputed from a file alone by `file_checksum`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import torch

from .hidden import FORMAT, ShardMeta, binary_columns, shard_schema
from .io import atomic_path, log, write_json

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
        shapes = {
            "hidden": (n, self.width),
            "scale": (n,),
            "last_hidden": (n, self.meta.hidden_size),
            "last_scale": (n,),
        }
        return {k: (shapes[k], self.torch_dtype if "hidden" in k else torch.float32) for k in self.columns}

    def _raws(self, sample_id, n: int, mask_len: int, tensors: dict) -> list[np.ndarray]:
        """The given binary columns' bytes, in schema order, once they are what the shard holds."""
        got = {k: (tuple(t.shape), t.dtype) for k, t in tensors.items() if t is not None}
        self._check(sample_id, n, mask_len, got, self._want(n))
        return [_raw(tensors[k]) for k in self.columns]

    def write(
        self,
        sample_id: str,
        input_ids,
        loss_mask,
        hidden: torch.Tensor,
        scale=None,
        last_hidden=None,
        last_scale=None,
    ) -> None:
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
