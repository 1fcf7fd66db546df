"""Hidden-state store: writer/reader round trip, verification, precompute against a direct forward."""

import json
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

from flashdraft import hidden
from flashdraft.chat import tokenize_conversation
from flashdraft.config import DrafterConfig, HiddenConfig, ToyConfig
from flashdraft.hidden import (
    HiddenStore,
    ShardWriter,
    manifest_path,
    open_shard,
    precompute_shard,
    preflight,
    shard_of,
    token_batches,
    verify_shard,
    write_manifest,
)
from flashdraft.target import load_target, select_features
from flashdraft.toy import build_toy_target, task_conversations

REPO = Path(__file__).resolve().parents[1]
LAYERS = DrafterConfig(num_layers=3)  # toy target has 6 layers -> features of layers [1, 2, 3]
CFG = HiddenConfig(max_length=96, batch_tokens=256, dtype="bfloat16")


def write_shard(path, rows, dtype="bfloat16", layer_ids=(1, 3), hidden_size=8, target="tgt", **kw):
    """Write (id, input_ids, loss_mask, hidden) rows to a shard + manifest; return the manifest."""
    meta = dict(target=target, layer_ids=list(layer_ids), hidden_size=hidden_size, dtype=dtype)
    with open_shard(path, **meta, **kw) as w:
        for row in rows:
            w.write(*row)
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
    digest = hidden.file_sha256(paths[0])
    store[0]["hidden"].add_(1)
    assert hidden.file_sha256(paths[0]) == digest
    assert torch.equal(HiddenStore(paths[:1])[0]["hidden"].view(bits), flat[0][3].view(bits))


def test_store_rejects_mismatched_shards(tmp_path):
    a, b = tmp_path / "a.arrow", tmp_path / "b.arrow"
    write_shard(a, random_rows(2, torch.bfloat16))
    write_shard(b, random_rows(2, torch.bfloat16, width=24), layer_ids=(1, 2, 3))
    with pytest.raises(ValueError, match=r"b\.arrow.*target_layer_ids"):
        HiddenStore([a, b])


def test_writer_rejects_bad_rows_and_leaves_no_file(tmp_path):
    path = tmp_path / "shard.arrow"
    (sid, ids, mask, h) = random_rows(1, torch.bfloat16)[0]
    with pytest.raises(ValueError, match="hidden"):
        write_shard(path, [(sid, ids, mask, h), (sid, ids, mask, h.float())])  # wrong dtype
    with pytest.raises(ValueError, match="mask"):
        write_shard(path, [(sid, ids, mask[:-1], h)])
    assert list(tmp_path.iterdir()) == []  # no final file, no manifest, no temporary left behind


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

    assert "sha256" in corrupt("flipped", flip)

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
    cmd = [sys.executable, str(REPO / "scripts" / "verify_hidden.py"), "--out", str(out), str(good), str(bad)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode != 0
    assert f"failed verification: {bad}" in proc.stderr
    summary = json.loads(out.read_text())
    assert [s["ok"] for s in summary["shards"]] == [True, False] and summary["ok"] is False


def test_preflight_and_storage_dtype(tmp_path):
    assert preflight(1000, 40, tmp_path / "not" / "yet") == 44000
    with pytest.raises(RuntimeError, match=r"need about [\d.]+ GiB .*but only [\d.]+ GiB") as e:
        preflight(10**15, 4, tmp_path)
    assert f"({10**15 * 4 * 11 // 10} bytes" in str(e.value)
    with pytest.raises(ValueError, match="fp8"):
        hidden.storage_dtype("float8_e4m3fn")


def test_shard_assignment_and_token_batches():
    # pinned values: the assignment must not change between processes, machines or Python versions
    assert [shard_of(f"s{i}", 4) for i in range(8)] == [1, 0, 2, 1, 3, 1, 0, 1]
    assert {shard_of(str(i), 5) for i in range(200)} == set(range(5))

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
    manifests = [
        precompute_shard(toy_target, "float32", train_parquet, s, 2, shards[s], CFG, LAYERS) for s in range(2)
    ]
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


def _rows(path):
    return pa.ipc.open_file(pa.memory_map(str(path))).read_all().select(["id"]).to_pylist()


def test_precompute_cli_is_deterministic(precomputed, toy_target, train_parquet, tmp_path, capsys):
    shards, manifests = precomputed
    out = tmp_path / "again.arrow"
    cli = runpy.run_path(str(REPO / "scripts" / "precompute_hidden.py"))  # the script's main(), in-process
    cfg = json.dumps({"max_length": CFG.max_length, "batch_tokens": CFG.batch_tokens})
    args = f"--target {toy_target} --dtype float32 --data {train_parquet} --shard 1 --num-shards 2"
    cli["main"](["--cfg", cfg, "--drafter-cfg", '{"num_layers": 3}', *args.split(), "--out", str(out)])
    again = json.loads(manifest_path(out).read_text())
    assert again["sha256"] == manifests[1]["sha256"] == hidden.file_sha256(shards[1])
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
        monkeypatch.setattr(ShardWriter, "write", failing(ShardWriter.write))
    else:  # the forward pass fails on the main thread while rows are queued
        monkeypatch.setattr(hidden, "forward_features", failing(hidden.forward_features))
    out = tmp_path / "hidden" / "shard-00000.arrow"
    with pytest.raises((OSError, RuntimeError), match=f"injected failure in the {where}"):
        precompute_shard(toy_target, "float32", train_parquet, 0, 1, out, CFG, LAYERS)
    assert calls["n"] == 3
    assert list(out.parent.iterdir()) == []  # no shard, no manifest, no temporary
