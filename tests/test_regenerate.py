import dataclasses
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import toy_prompt_set

from flashdraft.config import RegenerateConfig, TargetConfig, to_json
from flashdraft.errors import UserError
from flashdraft.regenerate import regenerate
from flashdraft.shards import shard_of

pytestmark = pytest.mark.usefixtures("one_thread")

ROOT = Path(__file__).resolve().parents[1]
CFG = RegenerateConfig(max_new_tokens=6, batch_size=3, part_rows=6)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """A random tiny toy target and a prompt set of 40 toy prompts."""
    return toy_prompt_set(tmp_path_factory.mktemp("regen"), num_docs=300)


def _target(data) -> TargetConfig:
    return TargetConfig(path=str(data / "target"), dtype="float32")


def _run(data, out_dir, cfg=CFG, prompts_file="prompts/train.parquet"):
    out = out_dir / "train.parquet"
    s = regenerate(cfg, _target(data), str(data / prompts_file), str(out), str(out_dir / "parts"))
    return s, pq.read_table(out)


@pytest.fixture(scope="module")
def reference(data):
    return _run(data, data / "reference")


def test_regenerate_rows(data, reference):
    stats, table = reference
    src = pq.read_table(data / "prompts/train.parquet").to_pylist()
    rows = table.to_pylist()
    assert [r["id"] for r in rows] == [r["id"] for r in src]  # prompt order
    assert table.schema.field("response_tokens").type == "int32"
    for r, p in zip(rows, src, strict=True):
        assert r["messages"][:-1] == [m for m in p["messages"] if m["role"] != "assistant"]
        assert r["messages"][-1]["role"] == "assistant"
        assert r["finish_reason"] in ("stop", "length") and 0 <= r["response_tokens"] <= CFG.max_new_tokens
        assert (r["finish_reason"] == "length") == (r["response_tokens"] == CFG.max_new_tokens)
    assert stats["rows"] == 40 and stats["errors"] == 0
    assert pq.read_table(data / "reference/errors.parquet").num_rows == 0
    assert len(list((data / "reference/parts").glob("part-*.parquet"))) == 7  # 14 batches, 2 per part


def test_resume_skips_committed_ids(data, reference, tmp_path):
    _run(data, tmp_path)
    parts = sorted((tmp_path / "parts").glob("part-*.parquet"))
    (tmp_path / "train.parquet").unlink()
    for p in parts[3:]:
        p.unlink()
    # mark the kept rows: a resumed run must reuse them, not generate them again
    kept = pq.read_table(parts[0]).to_pylist()
    for r in kept:
        r["messages"][-1]["content"] = "KEPT"
    pq.write_table(pa.Table.from_pylist(kept, schema=pq.read_schema(parts[0])), parts[0])
    _, table = _run(data, tmp_path)
    rows = table.to_pylist()
    ids = [r["id"] for r in rows]
    assert len(ids) == len(set(ids)) == 40
    assert sum(r["messages"][-1]["content"] == "KEPT" for r in rows) == len(kept)
    for r in rows:
        if r["messages"][-1]["content"] == "KEPT":
            r["messages"][-1]["content"] = next(
                x["messages"][-1]["content"] for x in reference[1].to_pylist() if x["id"] == r["id"]
            )
    assert rows == reference[1].to_pylist()  # the rest equals an uninterrupted run


def test_stale_parts_are_cleared(data, tmp_path):
    _run(data, tmp_path)
    _, table = _run(data, tmp_path, RegenerateConfig(max_new_tokens=2, batch_size=3, part_rows=6))
    assert max(table.column("response_tokens").to_pylist()) <= 2


def test_a_moved_target_and_prompts_keep_the_parts_answered_so_far(data, reference, tmp_path):
    """The work dir is keyed by the target's content and the prompts' ids, not their paths: a copy of
    both elsewhere (a moved checkout) reuses every committed part, and a work dir keyed by paths (as
    before) is taken over; other weights under the same config start over."""
    import json
    import shutil

    from flashdraft.regenerate import work_key

    moved = tmp_path / "moved"
    shutil.copytree(data / "target", moved / "target")
    shutil.copytree(data / "prompts", moved / "prompts")
    work = tmp_path / "run"
    _run(data, work)
    parts = sorted((work / "parts").glob("part-*.parquet"))
    marked = pq.read_table(parts[0]).to_pylist()
    for r in marked:
        r["messages"][-1]["content"] = "KEPT"
    pq.write_table(pa.Table.from_pylist(marked, schema=pq.read_schema(parts[0])), parts[0])
    _, table = _run(moved, work)
    assert sum(r["messages"][-1]["content"] == "KEPT" for r in table.to_pylist()) == len(marked)
    # a work dir keyed as before (resolved paths) is still ours, and rekeyed
    meta = work / "parts" / "meta.json"
    key = json.loads(meta.read_text())
    before = {
        "target": str((moved / "target").resolve()),
        "dtype": "float32",
        "cfg": key["cfg"],
        "prompts": str((moved / "prompts" / "train.parquet").resolve()),
    }
    meta.write_text(json.dumps(before))
    _, table = _run(moved, work)
    assert sum(r["messages"][-1]["content"] == "KEPT" for r in table.to_pylist()) == len(marked)
    assert json.loads(meta.read_text()) == key
    # other weights with the same config.json: another target
    weights = next((moved / "target").glob("*.safetensors"))
    blob = bytearray(weights.read_bytes())
    blob[-8:] = bytes(8)
    weights.write_bytes(bytes(blob))
    assert work_key(moved / "target", "float32", {}, ["a"]) != work_key(data / "target", "float32", {}, ["a"])
    assert work_key(data / "target", "float32", {}, ["a", "b"]) == work_key(
        data / "target", "float32", {}, ["b", "a"]
    )


def test_a_rerun_retries_failed_rows_by_their_cause(data, reference, tmp_path):
    """Committed failed rows: one the server failed (`answer`) is answered again by every rerun, one that
    failed for its own reason (`prompt`) only with retry_failed: true."""
    import pyarrow as pa

    from flashdraft.io import write_parquet
    from flashdraft.regenerate import Regenerated, parts_schema

    _run(data, tmp_path)
    prompts = pq.read_table(data / "prompts/train.parquet").to_pylist()
    failed = [
        Regenerated.failed(prompts[0], "HTTP 400: bad", "answer").row(),
        Regenerated.failed(prompts[1], "TemplateError: x", "prompt").row(),
    ]
    part = tmp_path / "parts/part-00100.parquet"
    write_parquet(pa.Table.from_pylist(failed, schema=parts_schema(error=True)), part)
    stats, table = _run(data, tmp_path)
    assert stats["errors"] == 1 and table.num_rows == 39
    assert pq.read_table(tmp_path / "errors.parquet").to_pylist() == [
        {"id": prompts[1]["id"], "source": prompts[1]["source"], "reason": "TemplateError: x"}
    ]
    assert table.to_pylist() == [r for r in reference[1].to_pylist() if r["id"] != prompts[1]["id"]]
    before = sorted((tmp_path / "parts").glob("part-*.parquet"))
    _, table = _run(data, tmp_path, dataclasses.replace(CFG, retry_failed=True))
    assert table.equals(reference[1])
    after = sorted((tmp_path / "parts").glob("part-*.parquet"))  # the parts kept, one more: the retried row
    assert after[:-1] == before and pq.read_table(after[-1]).column("id").to_pylist() == [prompts[1]["id"]]


def test_disabled_copies_answers_and_counts_missing(data, tmp_path):
    import pyarrow as pa

    rows = pq.read_table(data / "prompts/train.parquet").to_pylist()
    off = RegenerateConfig(enabled=False)
    stats, table = _run(data, tmp_path, off)
    assert table.column("messages").to_pylist() == [r["messages"] for r in rows]
    assert set(table.column("finish_reason").to_pylist()) == {"stop"}
    assert min(table.column("response_tokens").to_pylist()) > 0
    # 1 of 40 without an answer: recorded and tolerated; 3 of 40 (> 5%): the stage fails
    for n_missing, ok in [(1, True), (3, False)]:
        cut = [dict(r, messages=r["messages"][:1]) if i < n_missing else r for i, r in enumerate(rows)]
        pq.write_table(pa.Table.from_pylist(cut), tmp_path / f"cut{n_missing}.parquet")
        out = tmp_path / f"out{n_missing}"
        if ok:
            stats, table = _run(data, out, off, tmp_path / f"cut{n_missing}.parquet")
            assert stats == {"rows": 39, "errors": 1, "stop": 39, "length": 0} and table.num_rows == 39
        else:
            with pytest.raises(UserError, match="3 of 40 rows failed"):
                _run(data, out, off, tmp_path / f"cut{n_missing}.parquet")
            assert not (out / "train.parquet").exists()
        errors = pq.read_table(out / "errors.parquet").to_pylist()
        assert len(errors) == n_missing and errors[0]["reason"].startswith("no assistant answer")
    # the tolerated share is config: at 10%, 3 of 40 pass
    stats, _ = _run(
        data,
        tmp_path / "lenient",
        RegenerateConfig(enabled=False, max_error_fraction=0.1),
        tmp_path / "cut3.parquet",
    )
    assert stats["errors"] == 3 and stats["rows"] == 37


def test_shards_answer_exactly_their_rows_and_together_all(data, reference, tmp_path):
    """Three shard jobs: each answers the rows `shard_of` gives it, as the unsharded run answers them."""
    ref = {r["id"]: r for r in reference[1].to_pylist()}
    seen = []
    for s in range(3):
        out = tmp_path / f"shard{s}"
        stats = regenerate(
            CFG,
            _target(data),
            str(data / "prompts/train.parquet"),
            str(out / "train.parquet"),
            str(out / "parts"),
            s,
            3,
            str(out / "errors.parquet"),
        )
        rows = pq.read_table(out / "train.parquet").to_pylist()
        assert stats["rows"] == len(rows) > 0 and all(shard_of(r["id"], 3) == s for r in rows)
        assert rows == [ref[r["id"]] for r in rows]  # same answers, prompt order kept
        seen += [r["id"] for r in rows]
    assert sorted(seen) == sorted(ref)


@pytest.mark.parametrize("shard, num_shards", [(0, 1), (1, 2)], ids=["whole", "one-of-two-shards"])
def test_kill_and_rerun_script(data, reference, tmp_path, shard, num_shards):
    cfg = RegenerateConfig(max_new_tokens=6, batch_size=3, part_rows=3)  # a part every 3 rows
    out, parts = tmp_path / "train.parquet", tmp_path / "parts"
    cmd = [
        sys.executable,
        str(ROOT / "scripts/regenerate.py"),
        "--cfg",
        to_json(cfg),
        "--target-cfg",
        to_json(_target(data)),
        "--prompts",
        str(data / "prompts/train.parquet"),
        "--out",
        str(out),
        "--work-dir",
        str(parts),
        "--shard",
        str(shard),
        "--num-shards",
        str(num_shards),
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    while not list(parts.glob("part-*.parquet")) and proc.poll() is None:
        time.sleep(0.02)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ids = reference[1].column("id").to_pylist()
    ref = reference[1].filter([shard_of(x, num_shards) == shard for x in ids])
    n_parts = -(-ref.num_rows // 3)
    first = len(list(parts.glob("part-*.parquet")))
    assert not out.exists() and 1 <= first < n_parts
    done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
    assert f"{ref.num_rows} rows" in done.stdout
    assert pq.read_table(out).equals(ref)  # the killed run's rows and the rerun's, as one run's
    assert len(list(parts.glob("part-*.parquet"))) == n_parts


@pytest.mark.parametrize("engine", ["static", "generate"])
def test_a_prompt_past_the_targets_positions_is_a_recorded_failure(data, tmp_path, capsys, engine):
    """A prompt that with max_new_tokens needs more positions than the target has is failed with its
    reason (counted in the stage's errors, in errors.parquet), and does not size the static engine's
    slots; the other prompts are answered."""
    import pyarrow as pa
    from transformers import AutoTokenizer

    from flashdraft.toy import TOY_MAX_POSITIONS

    rows = pq.read_table(data / "prompts/train.parquet").to_pylist()[:5]
    long = dict(rows[0], id="long", messages=[{"role": "user", "content": "7" * TOY_MAX_POSITIONS}])
    schema = pq.read_schema(data / "prompts/train.parquet")
    pq.write_table(pa.Table.from_pylist([long, *rows], schema=schema), tmp_path / "prompts.parquet")
    cfg = dataclasses.replace(CFG, engine=engine, max_error_fraction=0.5)
    out, prompts = tmp_path / "train.parquet", str(tmp_path / "prompts.parquet")
    stats = regenerate(cfg, _target(data), prompts, str(out), str(tmp_path / "parts"))
    assert stats["rows"] == 5 and stats["errors"] == 1
    assert pq.read_table(out).column("id").to_pylist() == [r["id"] for r in rows]
    [error] = pq.read_table(tmp_path / "errors.parquet").to_pylist()
    tok = AutoTokenizer.from_pretrained(data / "target")
    text = tok.apply_chat_template(long["messages"], add_generation_prompt=True, tokenize=False)
    n, limit = len(tok(text, add_special_tokens=False)["input_ids"]), TOY_MAX_POSITIONS
    assert n > limit  # a token per digit
    assert error["id"] == "long" and error["reason"] == (
        f"longer than the target's positions: the prompt is {n} tokens, with regenerate.max_new_tokens "
        f"({CFG.max_new_tokens}) {n + CFG.max_new_tokens}, over its max_position_embeddings ({limit})"
    )
    if engine == "static":
        slots = re.search(r"static-cache engine, \d+ slots of (\d+) positions", capsys.readouterr().err)
        assert slots and int(slots[1]) < 100, slots


@pytest.mark.parametrize("engine", ["static", "generate"])
def test_top_k_1_regenerates_the_greedy_answers(data, reference, tmp_path, engine):
    """Sampled within top_k 1, every answer is the greedy one, in both engines of the hf backend; a wider
    top_k samples other answers."""
    greedy = (
        reference[1]
        if engine == "static"
        else _run(data, tmp_path / "greedy", dataclasses.replace(CFG, engine=engine))[1]
    )
    one = dataclasses.replace(CFG, engine=engine, temperature=1.5, top_k=1)
    assert _run(data, tmp_path / "top_k_1", one)[1].equals(greedy)
    wide = dataclasses.replace(CFG, engine=engine, temperature=1.5, top_k=50, top_p=0.95)
    assert not _run(data, tmp_path / "wide", wide)[1].equals(greedy)


def test_sampling_keys_left_unset_change_no_run(data, reference, tmp_path):
    """regenerate.top_p and top_k at their defaults (off) are neither in the stage's params (its rerun
    trigger) nor in the key of its parts, nor sent to a server: a run made before they existed redoes
    nothing. Set, they are in all three."""
    import json

    from flashdraft.config import stage_params
    from flashdraft.regenerate import sampling_fields

    default = json.loads(to_json(RegenerateConfig()))
    assert {"top_p", "top_k"} & set(stage_params("regenerate", default)) == set()
    assert sampling_fields(RegenerateConfig()) == {}
    held = json.loads((data / "reference" / "parts" / "meta.json").read_text())["cfg"]
    assert "top_p" not in held and "top_k" not in held
    cfg = RegenerateConfig(temperature=0.7, top_p=0.8, top_k=20)  # DeepSpec's data scripts' values
    assert {"top_p": 0.8, "top_k": 20}.items() <= stage_params("regenerate", json.loads(to_json(cfg))).items()
    assert sampling_fields(cfg) == {"top_p": 0.8, "top_k": 20}
    # parts keyed without them (as every run before them) are not another config's: they are kept
    work = tmp_path / "run"
    _run(data, work)
    parts = sorted((work / "parts").glob("part-*.parquet"))
    meta = json.loads((work / "parts" / "meta.json").read_text())
    assert meta["cfg"] == held and parts
    _run(data, work, dataclasses.replace(CFG, temperature=0.7, top_k=1))  # another config: started over
    assert json.loads((work / "parts" / "meta.json").read_text())["cfg"]["top_k"] == 1
