"""The precompute pipeline: the target's forward over a shard's samples, and the features it selects
written into a hidden-state shard (the format is hidden.py's).

One shard job, one GPU, three threads: the main thread runs the model (batches by token budget, the
decoder only through the deepest selected layer, or whole when the shard also holds the target's last
hidden state; packing and fp8 on the device, a copy to pinned host memory on a side stream); a writer
thread only appends the landed batches to the shard; the shard's hash threads checksum what it has
written. docs/architecture.md walks through it.
"""

from __future__ import annotations

import queue
import threading
import time
from pathlib import Path
from typing import NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from .chat import tokenize_conversation
from .config import DrafterConfig, HiddenConfig, TargetConfig
from .errors import UserError, disk_full, disk_full_error
from .hidden import ShardMeta, hidden_bytes, manifest_path, quantize_fp8
from .hidden_write import ShardWriter, open_shard, write_manifest
from .io import StorageDtype, device, free_bytes, human_bytes, log, progress
from .shards import shard_of
from .target import decoder_prefix, feature_layer_ids, layers_needed, load_target, select_features


def preflight(tokens: int, meta: ShardMeta, out_dir, margin: float = 0.1) -> int:
    """Refuse to start when the disk under `out_dir` cannot hold the estimated bytes (+ margin) of
    `tokens` tokens of shards like `meta`."""
    need = int(hidden_bytes(tokens, meta) * (1 + margin))
    free = free_bytes(out_dir)
    if need > free:
        fp8 = "" if meta.dtype.quantized else ", or set hidden.dtype: float8_e4m3 (halves it)"
        raise UserError(
            f"not enough disk space in {out_dir}: hidden states need about {human_bytes(need)} "
            f"({need} bytes: {tokens} tokens x {meta.token_bytes} bytes/token "
            f"+ {margin:.0%} margin) "
            f"but only {human_bytes(free)} ({free} bytes) are free; free space there, or lower "
            f"hidden.max_length{fp8}"
            ", or set hidden.mode: stream with hidden.disk_budget (two chunks on disk at once)"
        )
    return need


def tokenize_shard(tokenizer, data_parquet, shard: int, num_shards: int, max_length: int):
    """The shard's samples as (id, input_ids, loss_mask), plus counts of truncated and skipped samples."""
    table = pq.read_table(data_parquet, columns=["id", "messages"])
    mine = [shard_of(i, num_shards) == shard for i in table.column("id").to_pylist()]
    table = table.filter(pa.array(mine, pa.bool_()))
    samples, truncated, skipped = [], 0, 0
    columns = table.column("id").to_pylist(), table.column("messages").to_pylist()
    for sid, messages in zip(*columns, strict=True):
        ids, mask, cut = tokenize_conversation(tokenizer, messages, max_length=max_length)
        if not any(mask):  # nothing to learn from (no assistant token survived)
            skipped += 1
            continue
        truncated += cut
        samples.append((sid, ids, mask))
    return samples, truncated, skipped


def token_batches(lengths: list[int], batch_tokens: int, window: int = 1024) -> list[list[int]]:
    """Group indices into batches whose padded size (rows x longest) fits `batch_tokens` (at least one row).

    Sorting by length only within a window keeps padding low and the output order close to the input's."""
    batches = []
    for start in range(0, len(lengths), window):
        order = sorted(range(start, min(start + window, len(lengths))), key=lambda i: -lengths[i])
        cur = []
        for i in order:
            if cur and (len(cur) + 1) * lengths[cur[0]] > batch_tokens:  # cur[0] is the longest
                batches.append(cur)
                cur = []
            cur.append(i)
        if cur:
            batches.append(cur)
    return batches


class Features(NamedTuple):
    """A batch's columns as a shard stores them (ShardWriter.write_rows), the rows' T tokens back to back,
    and the event that marks their copy to the host done (None off CUDA)."""

    hidden: torch.Tensor  # [T, K*H] in the storage dtype
    scale: torch.Tensor | None  # float32 [T] for fp8, else None
    last_hidden: torch.Tensor | None  # [T, H]: the target's last hidden state, when asked for
    last_scale: torch.Tensor | None  # its own float32 [T] for fp8
    event: object = None


@torch.inference_mode()
def forward_features(
    model,
    batch_ids: list[list[int]],
    layer_ids: list[int],
    dtype: str | StorageDtype,
    pad_id: int,
    copy_stream=None,
    host_rows: int | None = None,
    last_hidden: bool = False,
) -> Features:
    """Target features of a batch, packed: [T, K*H] in the storage dtype with the rows' T tokens back to
    back (no padding), their float32 scales [T] for fp8; with `last_hidden`, the target's last hidden
    state (after its final norm: what its LM head reads) [T, H] too, quantized on its own for fp8.

    The forward runs right-padded, unmasked (see below), and only through the deepest selected layer
    (the whole decoder for `last_hidden`); packing and fp8 quantizing happen on the model's device, so the
    copy moves only real tokens (half the bytes for fp8). On CUDA the copy lands in pinned memory on
    `copy_stream`, so the next batch's forward overlaps it. `host_rows`: the size of the pinned buffers in
    tokens (default: this batch's)."""
    dev = next(model.parameters()).device
    lengths = [len(x) for x in batch_ids]
    width = max(lengths)
    ids = torch.full((len(batch_ids), width), pad_id, dtype=torch.long)
    for i, x in enumerate(batch_ids):
        ids[i, : len(x)] = torch.tensor(x)
    # flat indices of the real tokens, computed on the host (no device sync to find them)
    real = torch.cat([torch.arange(n) + i * width for i, n in enumerate(lengths)]).to(dev)
    num_layers = model.config.num_hidden_layers
    with decoder_prefix(model, num_layers if last_hidden else layers_needed(num_layers, layer_ids)):
        # The decoder alone: no LM head, whose logits would be [B, S, vocab]. No attention mask: padding
        # is on the right, so under causal attention no real token ever sees a pad, and without a mask
        # SDPA takes its fused causal (flash) kernel. The pads' own features are dropped below.
        out = model.base_model(input_ids=ids.to(dev), output_hidden_states=True, use_cache=False)
    feats = select_features(out.hidden_states, layer_ids).flatten(0, 1).index_select(0, real)
    last = out.last_hidden_state.flatten(0, 1).index_select(0, real) if last_hidden else None
    del out
    dtype = StorageDtype.of(dtype)

    def stored(x):  # (values, scale) as the shard stores them; each column quantized on its own
        return quantize_fp8(x) if dtype.quantized else (x.to(dtype.torch_dtype), None)

    packed = (*stored(feats), *(stored(last) if last_hidden else (None, None)))
    if dev.type != "cuda":
        return Features(*packed)

    compute = torch.cuda.current_stream(dev)
    stream = copy_stream or compute
    stream.wait_stream(compute)
    host = []
    with torch.cuda.stream(stream):
        for t in packed:
            if t is not None:
                t.record_stream(stream)  # the allocator must not hand this memory out before the copy ends
                # one pinned size for every batch, so the caching host allocator reuses its blocks
                # instead of pinning new memory (slow: cudaHostAlloc) whenever a batch is longer
                rows = max(host_rows or 0, t.shape[0])
                buf = torch.empty((rows, *t.shape[1:]), dtype=t.dtype, pin_memory=True)[: t.shape[0]]
                t = buf.copy_(t, non_blocking=True)
            host.append(t)
        event = torch.cuda.Event()
        event.record(stream)
    return Features(*host, event)


class WriterThread:
    """Runs `fn(item)` for queued items on one background thread that only does I/O.

    The bounded queue caps host memory at `depth` batches in flight; the model stays on the main thread
    (compiled code must never run off it). After an error the thread keeps draining, so `put` never hangs."""

    def __init__(self, fn, depth: int = 2):
        self.fn, self.queue, self.error, self.aborted = fn, queue.Queue(depth), None, False
        self.busy_s = self.wait_s = 0.0  # writer time in fn; producer time blocked on a full queue
        self.thread = threading.Thread(target=self._run, name="hidden-writer", daemon=True)
        self.thread.start()

    def _run(self):
        while (item := self.queue.get()) is not None:
            if self.error is None and not self.aborted:
                t0 = time.perf_counter()
                try:
                    self.fn(item)
                except BaseException as e:
                    self.error = e
                self.busy_s += time.perf_counter() - t0

    def put(self, item) -> None:
        self._check()
        t0 = time.perf_counter()
        self.queue.put(item)
        self.wait_s += time.perf_counter() - t0

    def close(self, abort: bool = False) -> None:
        """Wait for the queued items (or drop them on abort); re-raise a writer error here."""
        self.aborted = abort
        self.queue.put(None)
        self.thread.join()
        if not abort:
            self._check()

    def _check(self):
        if self.error is not None:
            raise RuntimeError(f"hidden-state writer thread failed: {self.error!r}") from self.error


def _write_rows(writer: ShardWriter, rows, features: Features) -> None:
    if features.event is not None:
        features.event.synchronize()  # the non-blocking device-to-host copy has landed
    writer.write_rows(rows, *features[:4])


PINNED_AHEAD = 4  # host buffers in flight: queued, being written, being hashed


def _pin_ahead(rows: int, meta: ShardMeta) -> None:
    """Pin PINNED_AHEAD buffers of each size forward_features asks for, and free them: the caching host
    allocator keeps them for reuse, so the loop never stalls on pinning new memory (cudaHostAlloc is slow
    and can wait for the device; `pinned_allocations` in benchmarks/results/precompute_hidden_gpu_*.json
    counts the loop's own)."""
    widths = [meta.width] + [meta.hidden_size] * meta.last_hidden  # hidden (and last_hidden)
    shapes = [((rows, w), meta.dtype.torch_dtype) for w in widths]
    if meta.dtype.quantized:  # and their scales
        shapes += [((rows,), torch.float32)] * len(widths)
    bufs = [torch.empty(shape, dtype=t, pin_memory=True) for shape, t in shapes for _ in range(PINNED_AHEAD)]
    del bufs


def write_shard(model, samples, out_arrow, meta: ShardMeta, batch_tokens: int, pad_id: int, desc="hidden"):
    """Forward `samples` [(id, input_ids, loss_mask)] through the model in token-budget batches and write
    their features to the shard `out_arrow` (atomically); returns the closed ShardWriter.

    The main thread only runs the model; a writer thread does the host-side I/O as copies land."""
    t_start = time.perf_counter()
    lengths = [len(x[1]) for x in samples]
    cuda = next(model.parameters()).device.type == "cuda"
    copy_stream = torch.cuda.Stream() if cuda else None
    if cuda:  # pin the host buffers before the loop (see _pin_ahead)
        _pin_ahead(batch_tokens, meta)
    bar = progress(total=sum(lengths), unit="tok", unit_scale=True, desc=desc)
    with open_shard(out_arrow, meta) as writer:
        io_thread = WriterThread(lambda item: _write_rows(writer, *item))
        try:
            for batch in token_batches(lengths, batch_tokens):
                rows = [samples[i] for i in batch]
                ids = [r[1] for r in rows]
                feats = forward_features(
                    model,
                    ids,
                    meta.target_layer_ids,
                    meta.dtype,
                    pad_id,
                    copy_stream,
                    host_rows=batch_tokens,
                    last_hidden=meta.last_hidden,
                )
                io_thread.put((rows, feats))
                bar.update(sum(lengths[i] for i in batch))
        except BaseException:
            io_thread.close(abort=True)
            raise
        finally:
            bar.close()
        t_loop = time.perf_counter()
        io_thread.close()
    # where the time went: a forward that waits on the writer is disk- (or checksum-) bound
    writer.timing = {
        "seconds": time.perf_counter() - t_start,
        "loop_s": t_loop - t_start,
        "waited_on_writer_s": io_thread.wait_s,
        "writer_busy_s": io_thread.busy_s,
    }
    return writer


def hidden_shard(
    target: TargetConfig,
    data_parquet,
    shard: int,
    num_shards: int,
    out_arrow,
    hidden_cfg: HiddenConfig,
    drafter_cfg: DrafterConfig,
    manifest=None,
    last_hidden: bool = False,
) -> dict:
    """Forward the target over this shard's samples and store the drafter's features; returns the manifest.

    `target.dtype` is what the target runs in, `hidden_cfg.dtype` what is stored; `last_hidden`
    (config.needs_last_hidden of the run's drafter): the target's last hidden state is stored too."""
    StorageDtype.of(hidden_cfg.dtype)  # fail before loading the model
    if not 0 <= shard < num_shards:
        raise ValueError(f"shard {shard} is outside 0..{num_shards - 1}")
    model, tokenizer = load_target(str(target.path), target.dtype, device())
    samples, truncated, skipped = tokenize_shard(
        tokenizer, data_parquet, shard, num_shards, hidden_cfg.max_length
    )
    counts = {"shard": shard, "num_shards": num_shards, "truncated": truncated, "skipped": skipped}
    return write_hidden(
        model,
        tokenizer,
        target.path,
        samples,
        out_arrow,
        hidden_cfg,
        drafter_cfg,
        desc=f"hidden shard {shard}/{num_shards}",
        counts=counts,
        manifest=manifest,
        last_hidden=last_hidden,
    )


def write_hidden(
    model,
    tokenizer,
    target_path,
    samples,
    out_arrow,
    hidden_cfg: HiddenConfig,
    drafter_cfg: DrafterConfig,
    desc: str,
    counts: dict,
    manifest=None,
    last_hidden: bool = False,
) -> dict:
    """Forward `samples` [(id, input_ids, loss_mask)] through the loaded target and write the drafter's
    features (and with `last_hidden` the target's last hidden state) to the shard `out_arrow` and its
    manifest (which adds `counts`); returns the manifest."""
    meta = ShardMeta(
        target=str(target_path),
        target_layer_ids=feature_layer_ids(model.config, drafter_cfg),
        hidden_size=model.config.hidden_size,
        dtype=hidden_cfg.dtype,
        last_hidden=last_hidden,
    )
    lengths = [len(s[1]) for s in samples]
    preflight(sum(lengths), meta, Path(out_arrow).parent, hidden_cfg.disk_margin)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0  # masked, right side

    try:
        writer = write_shard(model, samples, out_arrow, meta, hidden_cfg.batch_tokens, pad_id, desc=desc)
    except RuntimeError as e:  # the writer thread's error, re-raised here: name the shard it was writing
        if not disk_full(e.__cause__):
            raise
        raise disk_full_error(out_arrow) from e
    t = writer.timing
    log(
        f"{desc}: {writer.tokens} tokens in {t['seconds']:.1f} s "
        f"({writer.tokens / max(t['seconds'], 1e-9):.0f} tok/s); the forward waited "
        f"{t['waited_on_writer_s']:.1f} s on the writer thread, which was busy {t['writer_busy_s']:.1f} s"
    )
    return write_manifest(manifest or manifest_path(out_arrow), writer, **counts)
