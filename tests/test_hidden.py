"""Hidden-state store: writer/reader round trip, verification, precompute against a direct forward."""

import json
import os
import pickle
import runpy
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from flashdraft import hidden, hidden_write, precompute
from flashdraft.chat import tokenize_conversation
from flashdraft.config import DrafterConfig, HiddenConfig, TargetConfig, ToyConfig, to_json
from flashdraft.errors import UserError
from flashdraft.hidden import FP8, HiddenStore, ShardMeta, int_values, manifest_path, quantize_fp8
from flashdraft.hidden_verify import verify_shard
from flashdraft.hidden_write import ShardWriter, open_shard, write_manifest
from flashdraft.precompute import hidden_shard, preflight, token_batches
from flashdraft.shards import shard_of
from flashdraft.target import load_target, select_features
from flashdraft.toy import build_toy_target, task_conversations

REPO = Path(__file__).resolve().parents[1]
LAYERS = DrafterConfig(num_layers=3)  # toy target has 6 layers -> features of layers [1, 2, 3]
CFG = HiddenConfig(max_length=96, batch_tokens=256, dtype="bfloat16")


def write_shard(path, rows, dtype="bfloat16", layer_ids=(1, 3), hidden_size=8, target="tgt", **kw):
    """Write (id, input_ids, loss_mask, hidden) rows to a shard + manifest; return the manifest."""
    meta = ShardMeta(target=target, target_layer_ids=list(layer_ids), hidden_size=hidden_size, dtype=dtype)
    with open_shard(path, meta, **kw) as w:
        for sid, ids, mask, h in rows:
            w.write(sid, ids, mask, *quantize_fp8(h)) if dtype == FP8 else w.write(sid, ids, mask, h)
    return write_manifest(manifest_path(path), w, shard=0, num_shards=1, truncated=0, skipped=0)


def random_rows(n, dtype, width=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        t = 1 + int(torch.randint(1, 40, (1,), generator=g))
        h = (torch.randn(t, width, generator=g) * 10 ** torch.randint(-6, 6, (t, 1), generator=g)).to(dtype)
        h[0, :3] = torch.tensor([-0.0, 1e-40, 3e38])  # signed zero, subnormal (bf16 keeps them), near max
        ids = torch.randint(0, 500, (t,), generator=g).tolist()
        mask = torch.randint(0, 2, (t,), generator=g).tolist()
        rows.append((f"{seed}-{i}", ids, mask, h))
    return rows


def mapped_ranges(path):
    """Address ranges of `path` in this process's memory maps (Linux)."""
    target = str(Path(path).resolve())
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split()
        if len(parts) >= 6 and parts[5] == target:
            lo, hi = (int(x, 16) for x in parts[0].split("-"))
            ranges.append((lo, hi))
    return ranges


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_round_trip_bit_exact_and_zero_copy(tmp_path, dtype):
    torch_dtype = getattr(torch, dtype)
    rows = [random_rows(5, torch_dtype, seed=1), random_rows(4, torch_dtype, seed=2)]
    paths = [tmp_path / "shard-00000.arrow", tmp_path / "shard-00001.arrow"]
    for path, shard_rows in zip(paths, rows, strict=True):
        write_shard(path, shard_rows, dtype=dtype, max_rows=2)  # several record batches per shard

    store = HiddenStore(paths)
    flat = rows[0] + rows[1]
    assert len(store) == 9
    assert (store.hidden_size, store.num_features, store.dtype, store.layer_ids) == (8, 2, dtype, [1, 3])
    bits = torch.int16 if dtype == "bfloat16" else torch.int32
    for i, (sid, ids, mask, h) in enumerate(flat):
        item = store[i]
        assert store.num_tokens(i) == len(ids)
        assert item["id"] == sid
        assert item["input_ids"].tolist() == ids and item["loss_mask"].tolist() == mask
        assert item["hidden"].dtype == torch_dtype and item["hidden"].shape == h.shape
        assert torch.equal(item["hidden"].view(bits), h.view(bits))  # bit-exact, -0.0 and subnormals too
        # zero copy: the tensor's memory is the shard file's mapping
        ptr = item["hidden"].data_ptr()
        assert any(lo <= ptr < hi for lo, hi in mapped_ranges(paths[i >= 5])), "hidden was copied"
    assert store[-1]["id"] == flat[-1][0]
    assert torch.equal(pickle.loads(pickle.dumps(store))[7]["hidden"].view(bits), flat[7][3].view(bits))
    with pytest.raises(IndexError):
        store[9]

    # the mapping is copy-on-write: an in-place op changes this process's pages, never the shard
    digest = hidden_write.file_checksum(paths[0])
    store[0]["hidden"].add_(1)
    assert hidden_write.file_checksum(paths[0]) == digest
    assert torch.equal(HiddenStore(paths[:1])[0]["hidden"].view(bits), flat[0][3].view(bits))


def test_store_rejects_mismatched_shards(tmp_path):
    a, b = tmp_path / "a.arrow", tmp_path / "b.arrow"
    write_shard(a, random_rows(2, torch.bfloat16))
    write_shard(b, random_rows(2, torch.bfloat16, width=24), layer_ids=(1, 2, 3))
    with pytest.raises(ValueError, match=r"b\.arrow.*target_layer_ids"):
        HiddenStore([a, b])


def test_shard_meta_is_what_schema_and_manifest_both_say(tmp_path):
    path = tmp_path / "a.arrow"
    manifest = write_shard(path, random_rows(2, torch.bfloat16, width=24), layer_ids=(1, 2, 3))
    meta = HiddenStore([path]).meta
    assert meta == ShardMeta.from_dict(manifest) == ShardMeta("tgt", [1, 2, 3], "bfloat16", 8)
    assert meta.to_dict() == {k: manifest[k] for k in meta.to_dict()} and meta.width == 24
    with pytest.raises(ValueError, match="num_features 2 but 3"):
        ShardMeta.from_dict({**manifest, "num_features": 2})


# ------------------------------------------------------------------------ the target's last hidden state


def last_hidden_rows(n, dtype, width=16, hidden_size=8, seed=0):
    """random_rows, each with a last hidden state [t, hidden_size] of O(1) values: another range than the
    features' (up to 3e38), as a final-norm state is beside the mid-layer residual stream."""
    g = torch.Generator().manual_seed(seed + 100)
    return [
        (sid, ids, mask, h, torch.randn(len(ids), hidden_size, generator=g).to(dtype))
        for sid, ids, mask, h in random_rows(n, dtype, width, seed)
    ]


def write_last_hidden_shard(path, rows, dtype="bfloat16", rows_at_once=False, **kw):
    """Write (id, input_ids, loss_mask, hidden, last_hidden) rows to a shard with the last_hidden column,
    one row at a time or all as one write_rows; return the manifest."""

    def stored(x):
        return quantize_fp8(x) if dtype == FP8 else (x, None)

    with open_shard(path, ShardMeta("tgt", [1, 3], dtype, 8, last_hidden=True), **kw) as w:
        if rows_at_once:
            feats, last = (torch.cat([r[k] for r in rows]) for k in (3, 4))
            w.write_rows([r[:3] for r in rows], *stored(feats), *stored(last))
        else:
            for sid, ids, mask, h, last in rows:
                w.write(sid, ids, mask, *stored(h), *stored(last))
    return write_manifest(manifest_path(path), w)


@pytest.mark.parametrize("rows_at_once", [False, True], ids=["write", "write_rows"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", FP8])
def test_last_hidden_round_trip(tmp_path, dtype, rows_at_once):
    torch_dtype = torch.float32 if dtype == FP8 else getattr(torch, dtype)
    rows = last_hidden_rows(5, torch_dtype)
    path = tmp_path / "shard-00000.arrow"
    manifest = write_last_hidden_shard(path, rows, dtype, rows_at_once, max_rows=2)
    assert manifest["last_hidden"] is True
    assert verify_shard(path) == {"shard": str(path), "ok": True, "errors": []}
    schema = pa.ipc.open_file(pa.memory_map(str(path))).schema
    fp8 = dtype == FP8
    columns = ["hidden", "scale", "last_hidden", "last_scale"] if fp8 else ["hidden", "last_hidden"]
    assert schema.names[4:] == columns
    assert schema.metadata[b"flashdraft.last_hidden"] == b"true"

    store = HiddenStore([path])
    assert store.last_hidden and store.meta == ShardMeta("tgt", [1, 3], dtype, 8, last_hidden=True)
    assert ShardMeta.from_dict(manifest) == store.meta
    bits = {torch.bfloat16: torch.int16, torch.float32: torch.int32}.get(torch_dtype)
    for i, (sid, ids, mask, h, last) in enumerate(rows):
        item = store[i]
        assert item["id"] == sid and item["input_ids"].tolist() == ids and item["loss_mask"].tolist() == mask
        assert item["last_hidden"].shape == last.shape == (len(ids), 8) and item["hidden"].shape == h.shape
        if fp8:  # dequantized to bf16; each column by its own per-token scales
            assert item["last_hidden"].dtype == item["hidden"].dtype == torch.bfloat16
            assert torch.equal(store.stored(i, "last_scale"), quantize_fp8(last)[1])
            assert torch.equal(store.stored(i, "scale"), quantize_fp8(h)[1])
            # within e4m3's 3 mantissa bits of its own range (the features' scale would flush it to zero)
            err = (item["last_hidden"].float() - last).abs()
            assert (err <= 2**-3 * last.abs().amax(-1, keepdim=True)).all()
            assert (err <= 2**-4 * last.abs() + 2**-9 * last.abs().amax(-1, keepdim=True) / 448).all()
        else:  # bit-exact, zero copy
            assert item["last_hidden"].dtype == torch_dtype
            assert torch.equal(item["last_hidden"].view(bits), last.view(bits))
            assert torch.equal(item["hidden"].view(bits), h.view(bits))
            ptr = item["last_hidden"].data_ptr()
            assert any(lo <= ptr < hi for lo, hi in mapped_ranges(path)), "last_hidden was copied"
    assert torch.equal(pickle.loads(pickle.dumps(store))[3]["last_hidden"], store[3]["last_hidden"])


def test_a_shard_without_last_hidden_is_the_format_as_it_was(tmp_path):
    """Without the column: no `last_hidden` key in the schema metadata or the manifest, and the very bytes
    of a shard written with pyarrow alone in the format as it was before the key existed; such a shard
    reads without a last_hidden item and verifies."""
    rows = random_rows(3, torch.bfloat16)
    path = tmp_path / "new.arrow"
    manifest = write_shard(path, rows)  # one record batch
    assert set(manifest) == {
        "format",
        "target",
        "target_layer_ids",
        "dtype",
        "hidden_size",
        "num_features",
        "rows",
        "tokens",
        "bytes",
        "sha256_tree",
        "checksum_chunk_bytes",
        "shard",
        "num_shards",
        "truncated",
        "skipped",
    }
    metadata = {
        "flashdraft.format": "flashdraft.hidden/1",
        "flashdraft.target": "tgt",
        "flashdraft.target_layer_ids": "[1, 3]",
        "flashdraft.dtype": "bfloat16",
        "flashdraft.hidden_size": "8",
        "flashdraft.num_features": "2",
    }
    schema = pa.schema(
        [
            ("id", pa.string()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.int8())),
            ("num_tokens", pa.int32()),
            ("hidden", pa.large_binary()),
        ],
        metadata=metadata,
    )
    batch = pa.record_batch(
        [
            [r[0] for r in rows],
            [r[1] for r in rows],
            [r[2] for r in rows],
            [len(r[1]) for r in rows],
            [r[3].view(torch.uint8).numpy().tobytes() for r in rows],
        ],
        schema=schema,
    )
    old = tmp_path / "old.arrow"
    with pa.OSFile(str(old), "wb") as f, pa.ipc.new_file(f, schema) as w:
        w.write_batch(batch)
    assert old.read_bytes() == path.read_bytes()

    shutil.copy(manifest_path(path), manifest_path(old))
    store = HiddenStore([old])
    assert store.meta == ShardMeta("tgt", [1, 3], "bfloat16", 8) and not store.last_hidden
    assert "last_hidden" not in store[0] and verify_shard(old)["ok"]


def test_shards_with_and_without_last_hidden_do_not_mix(tmp_path):
    with_it, without = tmp_path / "with.arrow", tmp_path / "without.arrow"
    write_last_hidden_shard(with_it, last_hidden_rows(2, torch.bfloat16))
    write_shard(without, random_rows(2, torch.bfloat16))
    with pytest.raises(
        ValueError,
        match=r"shard .*without\.arrow has last_hidden=False but .*with\.arrow "
        r"has last_hidden=True: shards differ",
    ):
        HiddenStore([with_it, without])
    with pytest.raises(ValueError, match=r"shard .*with\.arrow has last_hidden=True but .*without\.arrow"):
        HiddenStore([without, with_it])
    assert len(HiddenStore([with_it, with_it])) == 4


def test_verify_checks_the_last_hidden_column_and_its_manifest_key(tmp_path):
    rows = last_hidden_rows(3, torch.float32)
    good = tmp_path / "good.arrow"
    write_last_hidden_shard(good, rows, FP8)
    manifest = json.loads(manifest_path(good).read_text())
    del manifest["last_hidden"]  # a manifest that says the shard has no such column
    manifest_path(good).write_text(json.dumps(manifest))
    want = f"{good}: schema metadata last_hidden=True but manifest says False"
    assert verify_shard(good)["errors"] == [want]

    bad = tmp_path / "bad.arrow"  # NaN in one row's last hidden state, a zero scale of another's
    with open_shard(bad, ShardMeta("tgt", [1, 3], FP8, 8, last_hidden=True)) as w:
        for k, (sid, ids, mask, h, last) in enumerate(rows):
            q, scale = quantize_fp8(last)
            if k == 0:
                q.view(torch.uint8)[1, 2] = 0x7F
            if k == 2:
                scale[0] = 0
            w.write(sid, ids, mask, *quantize_fp8(h), q, scale)
    write_manifest(manifest_path(bad), w)
    assert verify_shard(bad)["errors"] == [
        f"{bad}: row 0 (id '0-0'): last_hidden has NaN or Inf values",
        f"{bad}: row 2 (id '0-2'): last_scale has values that are not finite and > 0",
    ]


def test_writer_takes_last_hidden_exactly_when_the_shard_holds_it(tmp_path):
    sid, ids, mask, h, last = last_hidden_rows(1, torch.bfloat16)[0]
    with_it = ShardMeta("t", [1, 3], "bfloat16", 8, last_hidden=True)
    cases = [
        (ShardMeta("t", [1, 3], "bfloat16", 8), (h, None, last)),  # a shard without the column
        (with_it, (h,)),  # the column missing
        (with_it, (h, None, torch.cat([last, last], 1))),  # [n, 2H]
        (with_it, (h, None, last.float())),  # another dtype
        (
            ShardMeta("t", [1, 3], FP8, 8, last_hidden=True),  # fp8 values without their last_scale
            (*quantize_fp8(h.float()), quantize_fp8(last)[0]),
        ),
    ]
    for meta, tensors in cases:
        with pytest.raises(ValueError, match="last_"), open_shard(tmp_path / "x.arrow", meta) as w:
            w.write(sid, ids, mask, *tensors)
    assert list(tmp_path.iterdir()) == []


def test_a_family_that_needs_last_hidden_refuses_a_store_without_it(tmp_path):
    from flashdraft.hidden import StoreView, require_last_hidden

    without, with_it = tmp_path / "shard-00000.arrow", tmp_path / "shard-00001.arrow"
    write_shard(without, random_rows(2, torch.bfloat16))
    write_last_hidden_shard(with_it, last_hidden_rows(2, torch.bfloat16))
    for store in (HiddenStore([without]), StoreView(HiddenStore([without]), [1])):
        with pytest.raises(
            UserError,
            match=rf"hidden shard {without} has no last_hidden column "
            r".*drafter\.family dspark .*rerun the hidden stage",
        ) as e:
            require_last_hidden(store, "dspark")
        assert "\n" not in str(e.value)
    require_last_hidden(StoreView(HiddenStore([with_it]), [1]), "dspark")


def test_writer_rejects_bad_rows_and_leaves_no_file(tmp_path):
    path = tmp_path / "shard.arrow"
    (sid, ids, mask, h) = random_rows(1, torch.bfloat16)[0]
    with pytest.raises(ValueError, match="hidden"):
        write_shard(path, [(sid, ids, mask, h), (sid, ids, mask, h.float())])  # wrong dtype
    with pytest.raises(ValueError, match="mask"):
        write_shard(path, [(sid, ids, mask[:-1], h)])
    assert list(tmp_path.iterdir()) == []  # no final file, no manifest, no temporary left behind


def test_an_error_while_aborting_is_logged_and_the_first_is_raised(tmp_path, monkeypatch, capsys):
    close = hidden_write._HashingSink.close

    def failing_close(self):  # the file is closed, then closing fails (as a full disk can make it)
        close(self)
        raise OSError("no space left on device")

    monkeypatch.setattr(hidden_write._HashingSink, "close", failing_close)
    (sid, ids, mask, h) = random_rows(1, torch.bfloat16)[0]
    with pytest.raises(ValueError, match="mask") as e:
        write_shard(tmp_path / "shard.arrow", [(sid, ids, mask[:-1], h)])
    assert e.value.__context__ is None and e.value.__cause__ is None  # nothing chained onto it
    err = capsys.readouterr().err
    assert "while aborting after ValueError" in err and "no space left on device" in err
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("chunk", [1000, 4096, 1 << 26])
def test_checksum_is_a_sha256_tree_over_file_chunks(tmp_path, monkeypatch, chunk):
    """The writer's checksum (hashed from the buffers as they are written, chunks split across writes)
    equals one computed from the file alone, and the definition: sha256 over the chunks' sha256 digests."""
    import hashlib

    monkeypatch.setattr(hidden_write, "CHECKSUM_CHUNK", chunk)
    path = tmp_path / "shard-00000.arrow"
    manifest = write_shard(path, random_rows(60, torch.bfloat16), max_rows=4)
    data = path.read_bytes()
    assert len(data) > 10_000
    digests = [hashlib.sha256(data[i : i + chunk]).digest() for i in range(0, len(data), chunk)]
    want = hashlib.sha256(b"".join(digests)).hexdigest()
    assert manifest["sha256_tree"] == hidden_write.file_checksum(path, threads=3) == want
    assert manifest["checksum_chunk_bytes"] == chunk


@pytest.mark.parametrize("text", ["[]", "null"])
def test_a_manifest_that_is_not_an_object_fails_verification(tmp_path, text):
    shard = tmp_path / "shard-00000.arrow"
    write_shard(shard, random_rows(2, torch.bfloat16))
    manifest_path(shard).write_text(text)
    result = verify_shard(shard)
    assert not result["ok"] and "not a JSON object" in result["errors"][0]


def test_verify_catches_truncation_flipped_bytes_and_nan(tmp_path):
    good = tmp_path / "shard-00000.arrow"
    write_shard(good, random_rows(6, torch.bfloat16))
    assert verify_shard(good, manifest_path(good)) == {"shard": str(good), "ok": True, "errors": []}

    def corrupt(name, edit):
        path = tmp_path / f"{name}.arrow"
        shutil.copy(good, path)
        shutil.copy(manifest_path(good), manifest_path(path))
        data = bytearray(path.read_bytes())
        path.write_bytes(edit(data))
        result = verify_shard(path, manifest_path(path))
        assert not result["ok"] and result["errors"]
        assert all(e.startswith(str(path)) for e in result["errors"])  # each error names the shard
        return " ".join(result["errors"])

    errors = corrupt("truncated", lambda d: d[: len(d) // 2])
    assert "bytes" in errors and "cannot be read" in errors

    def flip(d):
        d[len(d) // 2 : len(d) // 2 + 4] = bytes(255 - x for x in d[len(d) // 2 : len(d) // 2 + 4])
        return d

    assert "checksum" in corrupt("flipped", flip)

    nan = tmp_path / "nan.arrow"
    rows = random_rows(3, torch.bfloat16)
    rows[1][3][2, 5] = float("nan")
    write_shard(nan, rows)  # manifest matches the file: only the row check can catch it
    result = verify_shard(nan, manifest_path(nan))
    assert result["errors"] == [f"{nan}: row 1 (id '0-1'): hidden has NaN or Inf values"]

    manifest = json.loads(manifest_path(good).read_text())
    manifest["tokens"] += 1
    manifest_path(good).write_text(json.dumps(manifest))
    assert "tokens" in verify_shard(good, manifest_path(good))["errors"][0]


def test_verify_cli_names_bad_shard(tmp_path):
    good, bad = tmp_path / "shard-00000.arrow", tmp_path / "shard-00001.arrow"
    write_shard(good, random_rows(2, torch.bfloat16))
    write_shard(bad, random_rows(2, torch.bfloat16))
    bad.write_bytes(bad.read_bytes()[:-100])
    out = tmp_path / "verify.json"
    cmd = [sys.executable, str(REPO / "scripts" / "hidden_verify.py"), "--out", str(out), str(good), str(bad)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "FLASHDRAFT_RERUN": "redo"})
    assert proc.returncode != 0
    assert f"failed verification: {bad}" in proc.stderr
    summary = json.loads(out.read_text())
    assert [s["ok"] for s in summary["shards"]] == [True, False] and summary["ok"] is False
    # the bad shard and its manifest are moved aside, kept; the good one stays; the message says so
    [arrow] = (tmp_path / "bad").glob("shard-00001.*.arrow")
    assert arrow.with_suffix(".json").exists() and not bad.exists() and not manifest_path(bad).exists()
    assert good.exists() and manifest_path(good).exists()
    assert f"moved {bad} -> {arrow}" in proc.stderr
    assert f"moved {manifest_path(bad)} -> {arrow.with_suffix('.json')}" in proc.stderr
    assert "Rerun to rebuild exactly these shards: redo" in proc.stderr


def test_preflight_and_storage_dtype(tmp_path):
    fp32 = ShardMeta("t", [1, 3], "float32", 5)
    assert preflight(1000, fp32, tmp_path / "not" / "yet") == 1000 * 45 * 11 // 10
    with pytest.raises(UserError, match=r"need about [\d.]+ [kMGTP]B .*but only [\d.]+ [kMGTP]B") as e:
        preflight(10**15, ShardMeta("t", [2], "bfloat16", 4), tmp_path)
    assert f"({int(10**15 * 13 * 1.1)} bytes" in str(e.value) and "x 13 bytes/token" in str(e.value)
    with pytest.raises(ValueError, match=r"'float8_e4m3fn' is not supported; use one of .*'float8_e4m3'"):
        hidden.storage_dtype("float8_e4m3fn")
    assert hidden.storage_dtype(FP8) == torch.float8_e4m3fn
    # features + the int32 id and int8 mask; fp8 adds one float32 scale per token
    assert [hidden.bytes_per_token(d, 2, 1024) for d in ("float32", "bfloat16", FP8)] == [8197, 4101, 2057]


def activations(t, width, g):
    """Activation-like rows: gaussian, per-token magnitudes over 4 decades, a few huge outlier channels."""
    x = torch.randn(t, width, generator=g) * 10 ** (4 * torch.rand(t, 1, generator=g) - 2)
    x[:, [7, width // 3, width - 5]] *= 80
    return x


def test_fp8_round_trip_error_and_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(6):
        t = int(torch.randint(20, 60, (1,), generator=g))
        x = activations(t, 2 * 1024, g)
        x[1] = 0  # an all-zero token must not get a zero scale
        rows.append((f"r{i}", list(range(t)), [1] * t, x))
    fp8, bf16 = tmp_path / "fp8.arrow", tmp_path / "bf16.arrow"
    manifest = write_shard(fp8, rows, dtype=FP8, layer_ids=(1, 3), hidden_size=1024, max_rows=4)
    write_shard(bf16, [(*r[:3], r[3].bfloat16()) for r in rows], layer_ids=(1, 3), hidden_size=1024)
    assert fp8.stat().st_size <= 0.52 * bf16.stat().st_size
    assert manifest["dtype"] == FP8 and verify_shard(fp8)["ok"]

    store = HiddenStore([fp8])
    assert store.dtype == FP8 and len(store) == 6
    for i, (sid, ids, _, x) in enumerate(rows):
        item = store[i]
        assert item["id"] == sid and item["input_ids"].tolist() == ids
        assert item["hidden"].dtype == torch.bfloat16 and item["hidden"].shape == x.shape
        err = (item["hidden"].float() - x).abs()
        amax = x.abs().amax(-1, keepdim=True)
        assert (err <= 2**-3 * amax).all()  # e4m3 keeps 3 mantissa bits of the token's range
        assert (err <= 2**-4 * x.abs() + 2**-9 * amax / 448).all()  # per element: half an ulp (+ subnormals)
        assert torch.equal(item["hidden"][1], torch.zeros(x.shape[1], dtype=torch.bfloat16))
        rel = err.norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-30)
        assert rel.max() < 0.05
    assert torch.equal(pickle.loads(pickle.dumps(store))[3]["hidden"], store[3]["hidden"])
    # the stored e4m3 bytes are read in place from the mapping, then dequantized
    raw = store.stored(0)
    assert raw.dtype == torch.float8_e4m3fn
    assert any(lo <= raw.data_ptr() < hi for lo, hi in mapped_ranges(fp8))
    assert torch.equal(raw.view(torch.uint8), quantize_fp8(rows[0][3])[0].view(torch.uint8).flatten())


def test_fp8_writer_and_verify_check_scales(tmp_path):
    g = torch.Generator().manual_seed(1)
    rows = [(f"r{i}", [5] * 9, [1] * 9, activations(9, 16, g)) for i in range(3)]
    good = tmp_path / "good.arrow"
    write_shard(good, rows, dtype=FP8)
    assert verify_shard(good)["ok"]

    # a flipped byte in the scale column: the sha256 catches it, and the scale check once the manifest agrees
    bad = tmp_path / "bad.arrow"
    data = bytearray(good.read_bytes())
    at = data.find(quantize_fp8(rows[0][3])[1].numpy().tobytes())
    assert at > 0
    data[at + 3] ^= 0x80  # sign bit of row 0's first scale (little endian)
    bad.write_bytes(data)
    manifest = json.loads(manifest_path(good).read_text())
    manifest_path(bad).write_text(json.dumps(manifest))
    assert "checksum" in " ".join(verify_shard(bad)["errors"])
    manifest.update(sha256_tree=hidden_write.file_checksum(bad))
    manifest_path(bad).write_text(json.dumps(manifest))
    assert verify_shard(bad)["errors"] == [
        f"{bad}: row 0 (id 'r0'): scale has values that are not finite and > 0"
    ]

    # NaN (e4m3fn has no Inf) in the values, and a zero scale, written through the writer
    nan = tmp_path / "nan.arrow"
    with open_shard(nan, ShardMeta("tgt", [1, 3], FP8, 8)) as w:
        q, scale = quantize_fp8(rows[0][3])
        q.view(torch.uint8)[2, 5] = 0x7F
        w.write("a", *rows[0][1:3], q, scale)
        w.write("b", *rows[1][1:3], *quantize_fp8(rows[1][3]))
        w.write("c", *rows[2][1:3], quantize_fp8(rows[2][3])[0], torch.zeros(9))
    write_manifest(manifest_path(nan), w)
    assert verify_shard(nan)["errors"] == [
        f"{nan}: row 0 (id 'a'): hidden has NaN or Inf values",
        f"{nan}: row 2 (id 'c'): scale has values that are not finite and > 0",
    ]

    sid, ids, mask, x = rows[0]
    with pytest.raises(ValueError, match="scale"):
        write_shard(tmp_path / "x.arrow", [(sid, ids, mask, x)], dtype=FP8, layer_ids=(1, 3), hidden_size=4)
    with pytest.raises(ValueError, match="scale"):  # fp8 values without their scales
        with open_shard(tmp_path / "y.arrow", ShardMeta("t", [1, 3], FP8, 8)) as w:
            w.write(sid, ids, mask, quantize_fp8(x)[0])
    with pytest.raises(ValueError, match="scale"):  # a bf16 shard takes no scale
        with open_shard(tmp_path / "z.arrow", ShardMeta("t", [1, 3], "bfloat16", 8)) as w:
            w.write(sid, ids, mask, x.bfloat16(), torch.ones(9))
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{n}.{e}" for n in ("good", "bad", "nan") for e in ("arrow", "json")
    )


def test_token_batches_fill_the_budget_within_their_window_longest_first():
    lengths = [5, 60, 7, 30, 30, 2, 90, 11, 64, 3]
    batches = token_batches(lengths, batch_tokens=100, window=4)
    assert sorted(i for b in batches for i in b) == list(range(10))
    for b in batches:
        assert len(b) == 1 or len(b) * max(lengths[i] for i in b) <= 100
        assert len({i // 4 for i in b}) == 1  # never mixes windows
        assert [lengths[i] for i in b] == sorted((lengths[i] for i in b), reverse=True)


# ------------------------------------------------------------------------------- precompute on a real target


@pytest.fixture(scope="session")
def toy_target(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy") / "target"
    build_toy_target(ToyConfig(steps=0, num_docs=200), str(path))
    return path


def target_section(path) -> TargetConfig:
    """The `target` config section of the toy target at `path`, run in float32 (the CPU)."""
    return TargetConfig(path=str(path), dtype="float32")


@pytest.fixture(scope="session")
def train_parquet(tmp_path_factory):
    convs = task_conversations(30, seed=7)
    convs.append([{"role": "user", "content": "A prompt without an answer."}])  # skipped: no loss tokens
    convs.append([{"role": "user", "content": "Count."}, {"role": "assistant", "content": "1, 2, 3. " * 60}])
    path = tmp_path_factory.mktemp("data") / "train.parquet"
    ids = [f"sample-{i}" for i in range(len(convs))]
    pq.write_table(pa.table({"id": ids, "source": ["toy"] * len(ids), "messages": convs}), path)
    return path


@pytest.fixture(scope="session")
def precomputed(toy_target, train_parquet, tmp_path_factory):
    out = tmp_path_factory.mktemp("hidden")
    shards = [out / f"shard-{s:05d}.arrow" for s in range(2)]
    target = target_section(toy_target)
    manifests = [hidden_shard(target, train_parquet, s, 2, shards[s], CFG, LAYERS) for s in range(2)]
    return shards, manifests


def test_precompute_matches_direct_forward(precomputed, toy_target, train_parquet):
    shards, manifests = precomputed
    store = HiddenStore(shards)
    table = pq.read_table(train_parquet).to_pylist()
    assert sum(m["skipped"] for m in manifests) == 1 and sum(m["truncated"] for m in manifests) == 1
    kept = [r["id"] for r in table if len(r["messages"]) > 1]
    assert sorted(store[i]["id"] for i in range(len(store))) == sorted(kept)
    assert sum(m["rows"] for m in manifests) == len(store) == len(table) - 1
    for s, path in enumerate(shards):
        assert all(shard_of(store_id, 2) == s for store_id in (r["id"] for r in _rows(path)))
        assert verify_shard(path, manifest_path(path))["ok"]
    assert store.layer_ids == [1, 2, 3] and store.hidden_size == 128 and store.dtype == "bfloat16"

    model, tokenizer = load_target(str(toy_target), "float32")
    messages = {r["id"]: r["messages"] for r in table}
    exact = []
    for i in range(len(store)):  # rows were batched with right padding; each must equal its own forward
        item = store[i]
        ids, mask, _ = tokenize_conversation(tokenizer, messages[item["id"]], max_length=CFG.max_length)
        assert item["input_ids"].tolist() == ids and item["loss_mask"].tolist() == mask
        with torch.inference_mode():
            out = model(input_ids=torch.tensor([ids], device=model.device), output_hidden_states=True)
        ref = select_features(out.hidden_states, store.layer_ids)[0].cpu()
        torch.testing.assert_close(item["hidden"].float(), ref, rtol=2**-7, atol=1e-5)
        exact.append((item["hidden"] == ref.to(torch.bfloat16)).float().mean())
    assert min(exact) > 0.99  # equal up to bf16 rounding


def test_precompute_fp8_end_to_end(precomputed, toy_target, train_parquet, tmp_path, monkeypatch):
    shards, manifests = precomputed
    need = []
    monkeypatch.setattr(precompute, "preflight", lambda tokens, meta, d, m: need.append(meta.token_bytes))
    out = tmp_path / "shard-00001.arrow"
    cfg = HiddenConfig(max_length=CFG.max_length, batch_tokens=CFG.batch_tokens, dtype=FP8)
    manifest = hidden_shard(target_section(toy_target), train_parquet, 1, 2, out, cfg, LAYERS)
    assert need == [3 * 128 + 4 + 5]  # preflight counts 1 byte per value + the scale
    assert manifest["dtype"] == FP8 and json.loads(manifest_path(out).read_text()) == manifest
    assert verify_shard(out)["ok"]
    assert (manifest["rows"], manifest["tokens"]) == (manifests[1]["rows"], manifests[1]["tokens"])
    assert manifest["bytes"] <= 0.55 * manifests[1]["bytes"]  # H=128: small rows, so Arrow overhead shows

    store, ref = HiddenStore([out]), HiddenStore([shards[1]])
    assert store.dtype == FP8 and store.layer_ids == ref.layer_ids
    for i in range(len(store)):
        item, want = store[i], ref[i]
        assert item["id"] == want["id"] and torch.equal(item["input_ids"], want["input_ids"])
        assert item["hidden"].dtype == torch.bfloat16 and item["hidden"].shape == want["hidden"].shape
        err = (item["hidden"].float() - want["hidden"].float()).norm(dim=-1)
        assert (err / want["hidden"].float().norm(dim=-1)).max() < 0.05


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_precompute_stores_the_target_s_last_hidden_state(
    precomputed, toy_target, train_parquet, tmp_path, dtype
):
    """With --last-hidden: the target's last hidden state (after its final norm, where the LM head reads:
    the head over it gives the target's logits) beside the features, which stay those of a shard without
    it (the bf16 store's, bit for bit)."""
    shards, manifests = precomputed
    out = tmp_path / "shard-00001.arrow"
    cli = runpy.run_path(str(REPO / "scripts" / "hidden_shard.py"))  # the script's main(), in-process
    cfg = HiddenConfig(max_length=CFG.max_length, batch_tokens=CFG.batch_tokens, dtype=dtype)
    cli["main"](
        [
            "--cfg",
            to_json(cfg),
            "--drafter-cfg",
            to_json(LAYERS),
            "--target-cfg",
            to_json(target_section(toy_target)),
            "--data",
            str(train_parquet),
            "--shard",
            "1",
            "--num-shards",
            "2",
            "--out",
            str(out),
            "--last-hidden",
        ]
    )
    manifest = json.loads(manifest_path(out).read_text())
    assert manifest["last_hidden"] is True and verify_shard(out)["ok"]
    assert (manifest["rows"], manifest["tokens"]) == (manifests[1]["rows"], manifests[1]["tokens"])
    store, ref = HiddenStore([out]), HiddenStore([shards[1]])
    model, _ = load_target(str(toy_target), "float32")
    tight = dtype == "float32"
    for i in range(len(store)):
        item = store[i]
        assert item["id"] == ref[i]["id"] and item["last_hidden"].shape == (len(item["input_ids"]), 128)
        if not tight:
            assert torch.equal(item["hidden"], ref[i]["hidden"])  # the whole decoder ran, same features
        with torch.inference_mode():
            ids = item["input_ids"][None]
            last = model.base_model(input_ids=ids).last_hidden_state[0]
            logits = model(input_ids=ids).logits[0]
            head = model.lm_head(item["last_hidden"].float())
        tol = {"rtol": 1e-5, "atol": 1e-5} if tight else {"rtol": 2**-7, "atol": 1e-5}
        torch.testing.assert_close(item["last_hidden"].float(), last, **tol)
        if tight:
            torch.testing.assert_close(head, logits, rtol=1e-5, atol=1e-4)
        else:  # within bf16 rounding of the head's input
            assert (head - logits).abs().max() < 0.05 * logits.abs().max()


def _rows(path):
    return pa.ipc.open_file(pa.memory_map(str(path))).read_all().select(["id"]).to_pylist()


def test_precompute_cli_is_deterministic(precomputed, toy_target, train_parquet, tmp_path, capsys):
    shards, manifests = precomputed
    out = tmp_path / "again.arrow"
    cli = runpy.run_path(str(REPO / "scripts" / "hidden_shard.py"))  # the script's main(), in-process
    cfg = json.dumps({"max_length": CFG.max_length, "batch_tokens": CFG.batch_tokens})
    target = to_json(target_section(toy_target))
    args = f"--data {train_parquet} --shard 1 --num-shards 2"
    cli["main"](
        [
            "--cfg",
            cfg,
            "--drafter-cfg",
            '{"num_layers": 3}',
            "--target-cfg",
            target,
            *args.split(),
            "--out",
            str(out),
        ]
    )
    again = json.loads(manifest_path(out).read_text())
    assert again["sha256_tree"] == manifests[1]["sha256_tree"] == hidden_write.file_checksum(shards[1])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"] == manifests[1]["rows"]


@pytest.mark.parametrize("where", ["writer", "model"])
def test_failed_precompute_leaves_no_file(toy_target, train_parquet, tmp_path, monkeypatch, where):
    calls = {"n": 0}

    def failing(original):
        def fn(*args, **kwargs):
            calls["n"] += 1
            if calls["n"] == 3:
                raise OSError(f"injected failure in the {where}")
            return original(*args, **kwargs)

        return fn

    if where == "writer":  # a row that fails to write, on the I/O thread
        monkeypatch.setattr(ShardWriter, "write_rows", failing(ShardWriter.write_rows))
    else:  # the forward pass fails on the main thread while rows are queued
        monkeypatch.setattr(precompute, "forward_features", failing(precompute.forward_features))
    out = tmp_path / "hidden" / "shard-00000.arrow"
    with pytest.raises((OSError, RuntimeError), match=f"injected failure in the {where}"):
        hidden_shard(target_section(toy_target), train_parquet, 0, 1, out, CFG, LAYERS)
    assert calls["n"] == 3
    assert list(out.parent.iterdir()) == []  # no shard, no manifest, no temporary


def test_killed_shard_leaves_no_file_and_rerun_equals_uninterrupted(toy_target, tmp_path):
    """kill -9 while the shard is half written: no final file; the rerun's manifest (checksum included)
    equals an uninterrupted run's."""
    import os
    import signal
    import time

    convs = task_conversations(300, seed=3)
    data = tmp_path / "train.parquet"
    ids = [f"k-{i}" for i in range(len(convs))]
    pq.write_table(pa.table({"id": ids, "source": ["toy"] * len(ids), "messages": convs}), data)
    cfg = HiddenConfig(max_length=CFG.max_length, batch_tokens=32, dtype="bfloat16")  # one row per batch
    ref_out = tmp_path / "ref" / "shard-00000.arrow"
    ref = hidden_shard(target_section(toy_target), data, 0, 1, ref_out, cfg, LAYERS)

    out = tmp_path / "run" / "shard-00000.arrow"
    cmd = [
        sys.executable,
        str(REPO / "scripts" / "hidden_shard.py"),
        "--cfg",
        json.dumps(cfg.__dict__),
        "--drafter-cfg",
        '{"num_layers": 3}',
        "--target-cfg",
        to_json(target_section(toy_target)),
        "--data",
        str(data),
        "--shard",
        "0",
        "--num-shards",
        "1",
        "--out",
        str(out),
    ]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    partial, deadline = 0, time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        tmps = list(out.parent.glob(".tmp-*")) if out.parent.exists() else []
        sizes = [p.stat().st_size for p in tmps if p.exists()]
        if sizes and max(sizes) > 64 << 10:  # rows are on disk, the shard is not finished
            partial = max(sizes)
            os.kill(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.002)
    proc.wait()
    assert partial, f"the run ended before it could be killed mid-shard: {proc.stderr.read()[-2000:]!r}"
    assert proc.returncode == -signal.SIGKILL
    assert not out.exists() and not manifest_path(out).exists()

    subprocess.run(cmd, env=env, check=True, capture_output=True)
    again = json.loads(manifest_path(out).read_text())
    assert again == ref and again["sha256_tree"] == hidden_write.file_checksum(out)
    assert verify_shard(out)["ok"]
    assert partial < again["bytes"]
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, manifest_path(out).name]  # temp gone


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["bfloat16", FP8])
def test_gpu_features_packed_quantized_on_device_copied_async_to_pinned(toy_target, dtype):
    """On the GPU: features come back packed (no padding) in pinned host memory through a side stream, with
    an event to wait on; fp8 is quantized on the device (its scales come back pinned too); each row equals
    its own unpadded forward through all layers, within bf16 (and e4m3) rounding."""
    dev = torch.device("cuda")
    model, _ = load_target(str(toy_target), "bfloat16", dev)
    layer_ids = [1, 2, 3]
    g = torch.Generator().manual_seed(0)
    batch = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (37, 5, 64, 20)]
    feats, scales, _, _, event = precompute.forward_features(
        model, batch, layer_ids, dtype, 0, torch.cuda.Stream()
    )
    assert event is not None and feats.device.type == "cpu" and feats.is_pinned()
    event.synchronize()
    assert feats.shape == (sum(map(len, batch)), 3 * model.config.hidden_size)
    if dtype == FP8:
        assert feats.dtype == torch.float8_e4m3fn and scales.is_pinned() and scales.shape == (feats.shape[0],)
        got = hidden.dequantize_fp8(feats, scales).float()
    else:
        assert feats.dtype == torch.bfloat16 and scales is None
        got = feats.float()
    refs = []
    with torch.inference_mode():
        for ids in batch:
            out = model(input_ids=torch.tensor([ids], device=dev), output_hidden_states=True)
            refs.append(select_features(out.hidden_states, layer_ids)[0].float().cpu())
    ref = torch.cat(refs)
    rel = (got - ref).norm(dim=-1) / ref.norm(dim=-1)
    assert rel.max() < (0.06 if dtype == FP8 else 0.02), rel.max()


def test_fp8_dequantize_in_blocks_is_bit_exact():
    x = torch.randn(150, 48) * torch.logspace(-3, 3, 150)[:, None]
    q, scale = quantize_fp8(x)
    want = (q.float() * scale.unsqueeze(-1)).to(torch.bfloat16)
    assert torch.equal(hidden.dequantize_fp8(q, scale, rows=64), want)
    assert torch.equal(hidden.dequantize_fp8(q, scale, rows=1), want)


def test_forward_runs_only_the_layers_the_features_need(toy_target):
    """Through the deepest selected layer plus one (HF's last hidden state is after the final norm);
    the model is whole again afterwards, also after an error inside."""
    from flashdraft.target import decoder_prefix, layers_needed

    assert layers_needed(36, [1, 9, 17, 25, 33]) == 35 and layers_needed(6, [1, 5]) == 6
    model, _ = load_target(str(toy_target), "float32")
    seen = []
    layers = model.model.layers
    hooks = [layer.register_forward_hook(lambda *a, i=i: seen.append(i)) for i, layer in enumerate(layers)]
    feats = precompute.forward_features(model, [[5, 6, 7, 8]], [1, 2], "float32", 0)
    assert seen == [0, 1, 2, 3] and feats.hidden.shape == (4, 2 * model.config.hidden_size)
    assert feats.last_hidden is None and feats.last_scale is None
    seen.clear()  # the target's last hidden state: the whole decoder runs
    feats = precompute.forward_features(model, [[5, 6, 7, 8], [9]], [1, 2], FP8, 0, last_hidden=True)
    assert seen == [0, 1, 2, 3, 4, 5] and feats.last_hidden.shape == (5, model.config.hidden_size)
    assert feats.last_hidden.dtype == torch.float8_e4m3fn and feats.last_scale.shape == (5,)
    exact = precompute.forward_features(model, [[5, 6, 7, 8], [9]], [1, 2], "float32", 0, last_hidden=True)
    for got, want in ((feats[2:4], quantize_fp8(exact.last_hidden)), (feats[:2], quantize_fp8(exact.hidden))):
        assert torch.equal(got[1], want[1])  # each column quantized on its own scales
        assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    with pytest.raises(RuntimeError), decoder_prefix(model, 2):
        assert len(model.model.layers) == 2
        raise RuntimeError("inside")
    assert len(model.model.layers) == 6
    for h in hooks:
        h.remove()


def test_int_values_are_to_numpys_and_a_store_reads_without_pandas(tmp_path):
    """HiddenStore reads its integer columns through int_values: to_numpy's values and dtype, for slices
    (a list row's values) and empty rows too, and without importing pandas (seconds of every training
    start; pyarrow's to_numpy and pa.array import it)."""
    lists = pa.array([[1, -2], [], [3, 4, 127]], pa.list_(pa.int8()))
    for arr in [
        *(lists[i].values for i in range(3)),
        pa.array(range(10), pa.int64()).slice(3, 4),
        pa.array([1, 2, 65535], pa.uint16()),
        pa.array([7], pa.int32()),
    ]:
        got, want = int_values(arr), arr.to_numpy(zero_copy_only=False)
        assert got.tolist() == want.tolist() and got.dtype == want.dtype
    with pytest.raises(TypeError):
        int_values(pa.array([1, None]))
    path = tmp_path / "shard.arrow"
    with open_shard(path, ShardMeta(target="t", target_layer_ids=[1], hidden_size=4, dtype="bfloat16")) as w:
        w.write("a", [5, 6, 7], [0, 1, 1], torch.zeros(3, 4, dtype=torch.bfloat16))
    code = (
        "import sys; from flashdraft.hidden import HiddenStore; s = HiddenStore([sys.argv[1]]); "
        "print(s.lengths.tolist(), s[0]['input_ids'].tolist(), s[0]['loss_mask'].tolist(), "
        "'pandas' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[3] [5, 6, 7] [0, 1, 1] False"
