import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flashdraft import prompts, toy
from flashdraft import sources as source_files
from flashdraft.config import PromptsConfig, SourceConfig, ToyConfig, to_json

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    return toy.write_toy_sources(ToyConfig(source_rows=60), str(tmp_path_factory.mktemp("sources")))


def _cfg(sources, **kw):
    return PromptsConfig(sources=[SourceConfig(name=k, path=v) for k, v in sources.items()], **kw)


def test_shapes_map_to_the_same_messages():
    want = [{"role": "user", "content": "What is 1 + 2?"}, {"role": "assistant", "content": "1 + 2 = 3."}]
    records = [
        (
            {
                "conversations": [
                    {"from": "human", "value": "What is 1 + 2?"},
                    {"from": "gpt", "value": "1 + 2 = 3."},
                ]
            },
            "sharegpt",
        ),
        ({"messages": want}, "messages"),
        ({"instruction": "What is 1 + 2?", "input": "", "output": "1 + 2 = 3."}, "alpaca"),
        ({"prompt": "What is 1 + 2?", "response": "1 + 2 = 3."}, "prompt"),
    ]
    for rec, shape in records:
        assert source_files.to_messages(rec, shape) == want
        assert source_files.to_messages(rec) == want  # auto detection
    renamed = {"question": "What is 1 + 2?", "answer": "1 + 2 = 3."}
    assert source_files.to_messages(renamed, "auto", {"question": "prompt", "answer": "response"}) == want
    alpaca = source_files.to_messages({"instruction": "Add them.", "input": "1 and 2"})
    assert alpaca == [{"role": "user", "content": "Add them.\n\n1 and 2"}]


def test_normalization_and_stable_id():
    a = source_files.to_messages({"prompt": "  Cafe\u0301 menu   \nline two\t\n"})
    b = source_files.to_messages({"prompt": "Caf\u00e9 menu\nline two"})
    assert a == b == [{"role": "user", "content": "Caf\u00e9 menu\nline two"}]
    sid = prompts.sample_id(a)
    assert len(sid) == 16 and int(sid, 16) >= 0 and sid == prompts.sample_id(b)
    assert sid != prompts.sample_id([{"role": "user", "content": "Cafe menu\nline two"}])
    code = source_files.to_messages({"prompt": "def f(x):\n    return x"})
    assert code[0]["content"] == "def f(x):\n    return x"  # indentation kept


@pytest.mark.parametrize(
    "record, reason",
    [
        ({"prompt": "   "}, "empty content"),
        ({"prompt": 7}, "non-string content"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "unknown role"),
        ({"messages": [{"role": "assistant", "content": "hi"}]}, "no user turn"),
        (
            {"messages": [{"role": "system", "content": "be nice"}, {"role": "assistant", "content": "hi"}]},
            "no user turn",
        ),
        ({"text": "hello"}, "unknown shape"),
        ({"prompt": "caf\ud800 au lait"}, "bad unicode"),
        (["not", "a", "dict"], "not a record"),
    ],
)
def test_rejects_with_reason(record, reason):
    with pytest.raises(source_files.Rejected, match=reason):
        source_files.to_messages(record)


def test_load_source_formats(tmp_path):
    rows = [{"prompt": f"Question {i}?"} for i in range(5)]
    (tmp_path / "a.jsonl").write_bytes(
        b"\n".join([json.dumps(r).encode() for r in rows] + [b'{"prompt": "caf\xe9"}', b"{oops"]) + b"\n"
    )
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "a.parquet")
    with (
        pa.OSFile(str(tmp_path / "a.arrow"), "wb") as f,
        pa.ipc.new_file(f, pa.Table.from_pylist(rows).schema) as w,
    ):
        w.write_table(pa.Table.from_pylist(rows))
    (tmp_path / "a.json").write_text(json.dumps(rows))
    for ext in ["jsonl", "parquet", "arrow", "json"]:
        got = list(source_files.load_source(SourceConfig(name=ext, path=str(tmp_path / f"a.{ext}"))))
        assert [r for _, r in got[:5]] == rows, ext
    bad = list(source_files.load_source(SourceConfig(name="j", path=str(tmp_path / "a.jsonl"))))[5:]
    assert [(i, r.reason) for i, r in bad] == [(5, "bad utf-8"), (6, "unparseable json")]
    folder = tmp_path / "hf" / "data"  # a local dataset folder, as `datasets` reads it offline
    folder.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows[:3]), folder / "train-00000-of-00002.parquet")
    pq.write_table(pa.Table.from_pylist(rows[3:]), folder / "train-00001-of-00002.parquet")
    hf = SourceConfig(name="hf", path=str(tmp_path / "hf"), format="hf", split="train")
    assert [r for _, r in source_files.load_source(hf)] == rows


def test_expand_toy_sources(sources, tmp_path):
    stats = prompts.expand(_cfg(sources, total=50, eval_count=8), str(tmp_path))
    train = pq.read_table(tmp_path / "train.parquet")
    evals = pq.read_table(tmp_path / "eval.parquet")
    assert train.schema.field("prompt_chars").type == pa.int32()
    msg_type = train.schema.field("messages").type
    assert pa.types.is_list(msg_type) and [f.name for f in msg_type.value_type] == ["role", "content"]
    assert (train.num_rows, evals.num_rows) == (50, 8)
    ids = train.column("id").to_pylist() + evals.column("id").to_pylist()
    assert len(set(ids)) == len(ids)  # unique, and eval disjoint from train
    for row in train.to_pylist():
        assert row["id"] == prompts.sample_id(row["messages"])
        assert row["prompt_chars"] == len(row["prompt"]) and row["num_turns"] == len(row["messages"])
    s = stats["sources"]
    # the malformed rows written by the toy sources, each with its reason
    assert s["sharegpt"]["rejected"] == {"empty content": 1, "unknown role": 1, "unparseable json": 1}
    assert s["messages"]["rejected"] == {"empty content": 1, "non-string content": 1, "too long": 1}
    assert s["alpaca"]["rejected"] == {"empty content": 1, "non-string content": 1}
    assert s["messages"]["duplicates"] >= 3 and s["alpaca"]["duplicates"] >= 3
    for st in s.values():
        gone = sum(st["rejected"].values()) + st["duplicates"] + st["near_duplicates"]
        assert st["read"] == st["kept"] + gone == 60 and st["augmented"] == 0
    assert stats["totals"]["sampled_train"] == 50
    assert not any(train.column("augmented").to_pylist())
    table = pq.read_table(tmp_path / "stats.parquet").to_pylist()
    assert [r["source"] for r in table] == list(s)
    for r in table:
        st = s[r["source"]]
        assert (
            r["rejected"] == sum(st["rejected"].values()) and dict(r["rejected_by_reason"]) == st["rejected"]
        )
        assert (r["kept"], r["duplicates"], r["sampled_train"]) == (
            st["kept"],
            st["duplicates"],
            st["sampled_train"],
        )
    rejects = pq.read_table(tmp_path / "rejects.parquet").to_pylist()
    assert len(rejects) == 8 and all(len(r["raw"]) <= 200 for r in rejects)
    assert json.loads((tmp_path / "stats.json").read_text()) == json.loads(json.dumps(stats))

    again = tmp_path / "again"
    prompts.expand(_cfg(sources, total=50, eval_count=8), str(again))
    assert pq.read_table(again / "train.parquet").equals(train)  # deterministic
    other = prompts.expand(_cfg(sources, total=50, eval_count=8, seed=1), str(tmp_path / "seed1"))
    assert other["totals"]["sampled_train"] == 50
    assert pq.read_table(tmp_path / "seed1" / "train.parquet").column("id").to_pylist() != ids[:50]


def test_weights_and_small_pool(sources, tmp_path):
    cfg = _cfg(sources, total=40, eval_count=0)
    cfg.sources[0].weight, cfg.sources[1].weight, cfg.sources[2].weight = 3.0, 1.0, 0.0
    s = prompts.expand(cfg, str(tmp_path / "w"))["sources"]
    assert (s["sharegpt"]["sampled_train"], s["messages"]["sampled_train"], s["alpaca"]["sampled_train"]) == (
        30,
        10,
        0,
    )
    big = prompts.expand(_cfg(sources, total=10_000, eval_count=5, augment=[]), str(tmp_path / "big"))
    assert big["totals"]["sampled_train"] + 5 == big["totals"]["kept"] == big["pool"]
    assert "smaller" in big["note"]


def _write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


LOREM = (
    "describe how the water cycle moves moisture between oceans clouds rivers and soil over one year "
    "and name the main forces that drive each stage of it in a temperate climate zone"
)


def test_exact_dedup_on_prompt_and_near_dup(tmp_path):
    records = [
        {"prompt": "What is the capital of France?", "response": "Paris."},
        {"prompt": "What is the capital of France?", "response": "It is Paris."},  # same prompt
        {"prompt": LOREM.capitalize() + "?"},
        {"prompt": LOREM.upper() + ", please!"},  # near duplicate: case, punctuation, one word more
        {"prompt": "Name three prime numbers."},
    ]
    src = SourceConfig(name="a", path=_write_jsonl(tmp_path / "a.jsonl", records))
    s = prompts.expand(PromptsConfig(sources=[src], total=3, eval_count=0), str(tmp_path / "on"))
    st = s["sources"]["a"]
    assert (st["kept"], st["duplicates"], st["near_duplicates"]) == (3, 1, 1)
    train = pq.read_table(tmp_path / "on" / "train.parquet").to_pylist()
    kept = {r["prompt"]: r for r in train}
    assert kept["What is the capital of France?"]["messages"][1]["content"] == "Paris."  # the first stays
    assert LOREM.capitalize() + "?" in kept  # the earlier of the near pair stays
    off = PromptsConfig(sources=[src], total=4, eval_count=0, near_dup=False)
    assert prompts.expand(off, str(tmp_path / "off"))["sources"]["a"]["kept"] == 4


def test_an_empty_source_file_is_warned_about_and_recorded(tmp_path, capsys):
    full = SourceConfig(name="full", path=_write_jsonl(tmp_path / "full.jsonl", [{"prompt": "Name a lake."}]))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    cfg = PromptsConfig(sources=[full, SourceConfig(name="empty", path=str(empty))], total=1, eval_count=0)
    summary = prompts.expand(cfg, str(tmp_path / "out"))
    message = f"source 'empty': {empty} has no rows; it contributes no prompts"
    assert summary["warnings"] == [message]
    assert f"warning: {message}" in capsys.readouterr().err
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["warnings"] == [message]
    assert "warnings" not in prompts.expand(
        PromptsConfig(sources=[full], total=1, eval_count=0), str(tmp_path / "full")
    )


def test_augment_fills_the_gap(tmp_path):
    records = [{"prompt": f"Write a short poem about the number {i}."} for i in range(30)]
    records += [
        {
            "messages": [
                {"role": "user", "content": f"Tell me about city {i}."},
                {"role": "assistant", "content": "A city."},
            ]
        }
        for i in range(10)
    ]
    a = SourceConfig(name="a", path=_write_jsonl(tmp_path / "a.jsonl", records[:30]), weight=3.0)
    b = SourceConfig(name="b", path=_write_jsonl(tmp_path / "b.jsonl", records[30:]))
    cfg = PromptsConfig(
        sources=[a, b], total=70, eval_count=2, augment=["{prompt} Answer briefly.", "Hi. {prompt}"]
    )
    s = prompts.expand(cfg, str(tmp_path / "out"))
    train = pq.read_table(tmp_path / "out" / "train.parquet").to_pylist()
    evals = pq.read_table(tmp_path / "out" / "eval.parquet").to_pylist()
    assert len(train) == 70 and len(evals) == 2 and not any(r["augmented"] for r in evals)
    aug = [r for r in train if r["augmented"]]
    assert len(aug) == s["totals"]["augmented"] == 70 - (40 - 2)
    assert s["sources"]["a"]["augmented"] == 3 * s["sources"]["b"]["augmented"]  # gap split by weight
    assert len({r["prompt"] for r in train + evals}) == 72 and len({r["id"] for r in train + evals}) == 72
    for r in aug:
        assert r["id"] == prompts.sample_id(r["messages"]) and r["messages"][-1]["role"] == "user"
        assert r["prompt"].endswith(" Answer briefly.") or r["prompt"].startswith("Hi. ")
    # eval stays disjoint: no training prompt is a variant of an eval prompt
    eval_prompts = {r["prompt"] for r in evals}
    for r in aug:
        base = r["prompt"].removesuffix(" Answer briefly.").removeprefix("Hi. ")
        assert base not in eval_prompts
    assert s["totals"]["sampled_train"] == 70 and "note" not in s
    again = prompts.expand(cfg, str(tmp_path / "again"))
    assert pq.read_table(tmp_path / "again" / "train.parquet").equals(
        pq.read_table(tmp_path / "out" / "train.parquet")
    )
    assert again == s
    short = prompts.expand(
        PromptsConfig(sources=[a, b], total=1000, eval_count=6, augment=["{prompt}!"]),
        str(tmp_path / "short"),
    )
    assert short["totals"]["sampled_train"] == 34 * 2 and "smaller" in short["note"]


def test_a_bom_is_read_past_and_a_lone_surrogate_is_a_counted_reject(tmp_path):
    """A UTF-8 BOM opening a .jsonl or .json file is not part of the first row; a lone UTF-16 surrogate
    (valid JSON, unwritable as UTF-8) rejects its row with a reason, the raw row kept readable."""
    rows = [{"prompt": f"What is {i} plus {i}?"} for i in range(6)]
    lines = [json.dumps(r) for r in rows]
    lines[3] = '{"prompt": "What is caf\\ud800?"}'  # the JSON escape of a lone surrogate
    (tmp_path / "a.jsonl").write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    (tmp_path / "b.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(rows[:2]).encode())
    srcs = [
        SourceConfig(name="a", path=str(tmp_path / "a.jsonl")),
        SourceConfig(name="b", path=str(tmp_path / "b.json")),
    ]
    s = prompts.expand(PromptsConfig(sources=srcs, total=5, eval_count=0), str(tmp_path / "out"))
    assert s["sources"]["a"]["rejected"] == {"bad unicode": 1} and s["sources"]["a"]["kept"] == 5
    assert s["sources"]["b"]["rejected"] == {} and s["sources"]["b"]["duplicates"] == 2  # rows 0, 1 of a
    [reject] = pq.read_table(tmp_path / "out" / "rejects.parquet").to_pylist()
    assert (reject["row"], reject["reason"]) == (3, "bad unicode") and "\\ud800" in reject["raw"]


def test_need_answers_keeps_only_answered_rows(tmp_path):
    """Regeneration disabled: a prompt-only row has nothing to train on, so it is rejected with a reason
    and no augmented (answerless) row fills the gap."""
    answered = [{"prompt": f"Name the number {i}.", "response": f"It is {i}."} for i in range(10)]
    bare = [{"prompt": f"What comes after {i}?"} for i in range(5)]
    src = SourceConfig(name="mixed", path=_write_jsonl(tmp_path / "mixed.jsonl", answered + bare))
    cfg = PromptsConfig(sources=[src], total=40, eval_count=2, augment=["{prompt} Answer briefly."])
    s = prompts.expand(cfg, str(tmp_path / "out"), need_answers=True)
    out = tmp_path / "out"
    rows = [r for f in ("train", "eval") for r in pq.read_table(out / f"{f}.parquet").to_pylist()]
    assert len(rows) == 10 and all(r["messages"][-1]["role"] == "assistant" for r in rows)
    assert s["sources"]["mixed"]["rejected"] == {prompts.NO_ANSWER: 5} and s["totals"]["augmented"] == 0
    assert "no augmentation" in s["note"] and s["need_answers"] is True
    rejects = pq.read_table(tmp_path / "out" / "rejects.parquet").to_pylist()
    assert [(r["row"], r["reason"]) for r in rejects] == [(i, prompts.NO_ANSWER) for i in range(10, 15)]
    assert json.loads((tmp_path / "out" / "stats.json").read_text())["totals"]["rejected"] == 5


def test_quotas_redistribute():
    assert prompts.quotas({"a": 100, "b": 5, "c": 100}, {"a": 1, "b": 1, "c": 2}, 60) == {
        "a": 18,
        "b": 5,
        "c": 37,
    }
    assert sum(prompts.quotas({"a": 3, "b": 4}, {"a": 1, "b": 1}, 100).values()) == 7


def test_cli(sources, tmp_path):
    cfg = to_json(_cfg(sources, total=20, eval_count=4))
    out = subprocess.run(
        [sys.executable, str(ROOT / "scripts/prompts.py"), "--cfg", cfg, "--out-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "train 20 (0 augmented), eval 4" in out
    assert pq.read_table(tmp_path / "eval.parquet").num_rows == 4
    bad = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/prompts.py"),
            "--cfg",
            '{"totl": 5}',
            "--out-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
    )
    assert bad.returncode != 0 and "unknown key" in bad.stderr


def test_cli_with_the_target_logs_the_prompts_too_long_for_it(short_target, tmp_path):
    rows = [{"prompt": "7" * 60}, {"prompt": "Name a lake."}, {"prompt": "Name a sea."}]
    src = SourceConfig(name="a", path=_write_jsonl(tmp_path / "a.jsonl", rows))
    cfg = to_json(PromptsConfig(sources=[src], total=1, eval_count=1, near_dup=False))
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "scripts/prompts.py"),
            "--cfg",
            cfg,
            "--out-dir",
            str(tmp_path / "out"),
            "--target",
            str(short_target),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert (
        "prompts: 1 longer than the target's positions (max_position_embeddings 40, in tokens of its "
        "tokenizer, one answer token left), rejected"
    ) in out


@pytest.fixture(scope="module")
def short_target(tmp_path_factory):
    """The toy's tokenizer (a token per digit) in a target directory whose config.json allows 40 positions."""
    d = tmp_path_factory.mktemp("target")
    toy.build_tokenizer(toy.task_conversations(200, 0), 512).save_pretrained(d)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen3", "max_position_embeddings": 40}))
    return d


def test_a_prompt_longer_than_the_target_takes_is_a_counted_reject(short_target, tmp_path):
    """Measured in the target's tokens as its chat template renders the prompt: one that leaves no room for
    an answer token within max_position_embeddings is rejected with its reason (counted per source, in
    rejects.parquet), and neither the train nor the eval set holds it; one token fewer is kept. The test is
    regeneration's (hf_config.past_positions)."""
    from transformers import AutoTokenizer

    from flashdraft.chat import prompt_ids
    from flashdraft.hf_config import past_positions

    tok = AutoTokenizer.from_pretrained(short_target)
    overhead = len(prompt_ids(tok, [{"role": "user", "content": "7"}])) - 1  # the template's tokens
    fits, over = "7" * (39 - overhead), "7" * (40 - overhead)  # 39 and 40 tokens: 40 positions
    assert len(prompt_ids(tok, [{"role": "user", "content": over}])) == 40
    assert not past_positions(39, 1, 40) and past_positions(40, 1, 40)
    records = [{"prompt": fits}, {"prompt": over}] + [{"prompt": f"Name the number {i}."} for i in range(6)]
    src = SourceConfig(name="a", path=_write_jsonl(tmp_path / "a.jsonl", records))
    cfg = PromptsConfig(sources=[src], total=5, eval_count=2, near_dup=False, augment=[])
    s = prompts.expand(cfg, str(tmp_path / "out"), target=short_target)
    reason = "longer than the target's positions (40)"
    assert s["sources"]["a"]["rejected"] == {reason: 1} and s["sources"]["a"]["kept"] == 7
    assert s["target"] == {"path": str(short_target), "max_position_embeddings": 40, "too_long": 1}
    [reject] = pq.read_table(tmp_path / "out" / "rejects.parquet").to_pylist()
    assert (reject["row"], reject["reason"]) == (1, reason)
    kept = [
        r["prompt"]
        for f in ("train", "eval")
        for r in pq.read_table(tmp_path / "out" / f"{f}.parquet").to_pylist()
    ]
    assert over not in kept and fits in kept and len(kept) == 7
    # without the target (a library call), characters alone decide, as before
    assert prompts.expand(cfg, str(tmp_path / "chars"))["sources"]["a"]["rejected"] == {}


def test_a_prompt_the_target_s_chat_template_cannot_render_is_a_counted_reject(short_target, tmp_path):
    import shutil

    target = tmp_path / "target"
    shutil.copytree(short_target, target)
    (target / "chat_template.jinja").write_text(  # a template that refuses system turns, as some do
        "{%- for m in messages %}{%- if m['role'] == 'system' %}{{ raise_exception('no system role') }}"
        "{%- endif %}{{- m['role'] + ': ' + m['content'] + '\\n' }}{%- endfor %}"
    )
    records = [
        {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi."}]},
        {"prompt": "Name a river."},
    ]
    src = SourceConfig(name="a", path=_write_jsonl(tmp_path / "a.jsonl", records))
    cfg = PromptsConfig(sources=[src], total=1, eval_count=0, near_dup=False, augment=[])
    s = prompts.expand(cfg, str(tmp_path / "out"), target=target)
    assert s["sources"]["a"]["rejected"] == {prompts.NO_RENDER: 1} and s["sources"]["a"]["kept"] == 1
