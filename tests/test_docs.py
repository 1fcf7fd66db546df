"""The README and docs/ against themselves and the config schema: the README stays short, every relative
link in them reaches an existing file (and heading), and docs/configuration.md names every key of the
schema and no other.

Each check is a function that returns its problems; the tests run it on the real files and on a broken
example, so a check that stopped finding anything would fail too.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import sys
import typing
from pathlib import Path

import pytest
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import figures  # noqa: E402  (benchmarks/figures.py)

from flashdraft import results
from flashdraft.config import Config
from flashdraft.config_load import SCHEMA  # the schema file the workflow and the planner validate against

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
CONFIG_DOC = DOCS / "configuration.md"
README_MAX_LINES = 200

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")


def doc_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(text: str) -> list[str]:
    """The lines outside fenced code blocks."""
    out, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append(line)
    return out


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[|\]\([^)]*\)", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a markdown file (a repeated heading gets -1, -2, ... as on GitHub)."""
    seen: dict[str, int] = {}
    out = set()
    for line in prose_lines(path.read_text()):
        m = re.match(r"#{1,6}\s+(.*)", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(path: Path) -> list[str]:
    """The relative links of `path` whose file, or heading in that file, does not exist."""
    problems = []
    for line in prose_lines(path.read_text()):
        for target in LINK.findall(line):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            file_part, _, anchor = target.partition("#")
            dest = (path.parent / file_part).resolve() if file_part else path
            where = f"{path.relative_to(REPO) if path.is_relative_to(REPO) else path}: ({target})"
            if not dest.exists():
                problems.append(f"{where}: no file {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: no heading #{anchor} in {dest.name}")
    return problems


def schema_keys(schema: dict, prefix: str = "") -> set[str]:
    """Every key of the schema, dotted (`train.lr`); list items as `[]` (`prompts.sources[].name`)."""
    keys = set()
    for name, sub in schema.get("properties", {}).items():
        key = f"{prefix}{name}"
        keys.add(key)
        keys |= schema_keys(sub, f"{key}.")
        items = sub.get("items")
        if isinstance(items, dict) and "properties" in items:
            keys |= schema_keys(items, f"{key}[].")
    return keys


def documented_keys(text: str) -> set[str]:
    """The keys of the reference tables: rows `| `section` | `key` | type | default | meaning |`."""
    keys = set()
    for line in prose_lines(text):
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 5 or not all(re.fullmatch(r"`[^`]+`", c) for c in cells[:2]):
            continue
        section, key = cells[0].strip("`"), cells[1].strip("`")
        keys.add(key if section == "(top level)" else f"{section}.{key}")
    return keys


def key_problems(text: str, schema: dict) -> list[str]:
    want, have = schema_keys(schema), documented_keys(text)
    return [f"docs/configuration.md lacks {k}" for k in sorted(want - have)] + [
        f"docs/configuration.md names {k}, which the schema lacks" for k in sorted(have - want)
    ]


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text())


# ---- the README's length ----


def test_readme_is_short():
    lines = len(README.read_text().splitlines())
    assert lines <= README_MAX_LINES, f"README.md: {lines} lines, over {README_MAX_LINES}; move text to docs/"


# ---- links ----


def test_every_relative_link_resolves():
    problems = [p for path in doc_files() for p in broken_links(path)]
    assert not problems, "broken links:\n" + "\n".join(problems)


def test_a_broken_link_is_found(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    doc = tmp_path / "doc.md"
    doc.write_text(
        "# Doc\n\n[ok](other.md#a-section) [same](#doc) [web](https://example.com)\n"
        "[gone](missing.md) [bad anchor](other.md#no-such-section) [own](#nowhere)\n"
        "```\n[in code](not-checked.md)\n```\n"
    )
    problems = broken_links(doc)
    assert len(problems) == 3, problems
    assert any("missing.md" in p for p in problems)
    assert any("#no-such-section" in p for p in problems)
    assert any("#nowhere" in p for p in problems)


def test_slug_matches_github():
    assert slug("Stream mode: a chunk job's start-up") == "stream-mode-a-chunk-jobs-start-up"
    assert slug("Files (all under `results/`)") == "files-all-under-results"
    assert (
        slug("The precompute pipeline (`precompute.write_shard`)")
        == "the-precompute-pipeline-precomputewrite_shard"
    )


# ---- docs/configuration.md against the schema ----


def test_configuration_doc_names_every_schema_key_and_no_other():
    problems = key_problems(CONFIG_DOC.read_text(), load_schema())
    assert not problems, "\n".join(problems)


def test_a_missing_or_extra_key_is_found():
    schema = load_schema()
    keys = sorted(schema_keys(schema))
    assert {
        "results",
        "train.lr",
        "prompts.sources",
        "prompts.sources[].weight",
        "drafter.dspark.markov_rank",
    } <= set(keys)
    text = CONFIG_DOC.read_text()
    dropped = text.replace("| `train` | `lr` |", "| train | lr |")
    assert key_problems(dropped, schema) == ["docs/configuration.md lacks train.lr"]
    extra = text + "\n| `train` | `no_such_key` | integer | `0` | invented |\n"
    assert key_problems(extra, schema) == [
        "docs/configuration.md names train.no_such_key, which the schema lacks"
    ]


# ---- docs/configuration.md's reference, generated from the schema and the dataclasses' defaults ----

REFERENCE_HEAD = """## Reference

Every key, by section. "required" marks a key without a default. Sizes such as `hidden.disk_budget`
take bytes or a string (`2TB`, `500GB`, `1.5TiB`).
"""


def type_text(prop: dict) -> str:
    types = prop.get("type", "object")
    types = types if isinstance(types, list) else [types]
    if "enum" in prop:
        return " or ".join(types) + ": " + " \\| ".join("null" if v is None else str(v) for v in prop["enum"])

    def one(t):
        items = prop.get("items", {})
        if t != "array":
            return t
        return "list of sources" if items.get("type") == "object" else f"list of {items.get('type', 'any')}"

    return " or ".join(map(one, types))


def value_text(v) -> str:
    if v is None or isinstance(v, bool):
        return f"`{json.dumps(v)}`"
    if isinstance(v, list) and v and all(isinstance(x, str) for x in v):
        return "; ".join(f"`{json.dumps(x)}`" for x in v)
    return f"`{json.dumps(v) if isinstance(v, list | dict) else v}`"


def default_text(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return value_text(f.default)
    if f.default_factory is not dataclasses.MISSING:
        v = f.default_factory()
        return "see below" if dataclasses.is_dataclass(v) else value_text(v)
    return "required"


def key_rows(cls, props: dict, section: str, required=()) -> list[str]:
    """One table row per key of `props` (the schema's) with its dataclass field, nested sections after."""
    fields, hints, out = {f.name: f for f in dataclasses.fields(cls)}, typing.get_type_hints(cls), []
    for name, prop in props.items():
        default = "required" if name in required else default_text(fields[name])
        meaning = prop.get("description", "")
        out.append(f"| `{section}` | `{name}` | {type_text(prop)} | {default} | {meaning} |")
        sub, inner = (name if section == "(top level)" else f"{section}.{name}"), hints[name]
        if typing.get_origin(inner) is list and dataclasses.is_dataclass(typing.get_args(inner)[0]):
            items, cls_ = prop["items"], typing.get_args(inner)[0]
            out += key_rows(cls_, items["properties"], f"{sub}[]", items.get("required", ()))
        elif dataclasses.is_dataclass(inner):
            out += key_rows(inner, prop["properties"], sub, prop.get("required", ()))
    return out


def reference(schema: dict) -> str:
    """docs/configuration.md from "## Reference" to its end."""
    out = [REFERENCE_HEAD]
    for name, prop in schema["properties"].items():
        out.append(f"### `{name}`\n")
        if prop.get("type") == "object" and prop.get("description"):
            out.append(prop["description"] + "\n")
        head = ["| section | key | type | default | meaning |", "| --- | --- | --- | --- | --- |"]
        out.append("\n".join([*head, *key_rows(Config, {name: prop}, "(top level)"), ""]))
    return "\n".join(out)


def test_the_configuration_reference_is_the_schema_s_with_the_dataclasses_defaults():
    """Its table is generated, so a key's type, default or meaning cannot drift from the code:
    `python tests/test_docs.py` writes it again after a schema or default change."""
    text = CONFIG_DOC.read_text()
    assert text[text.index("## Reference") :] == reference(load_schema())


def test_the_reference_follows_a_changed_default_or_description():
    schema = load_schema()
    schema["properties"]["train"]["properties"]["lr"]["description"] = "changed"
    rows = reference(schema).splitlines()
    assert any(r.startswith("| `train` | `lr` | number | `") and r.endswith("| changed |") for r in rows)
    assert "| `target` | `path` | string | required |" in reference(load_schema())


# ---- benchmarks/README.md's index, generated from the scripts, their results and their readers ----

BENCH = REPO / "benchmarks"
BENCH_README = BENCH / "README.md"
INDEX_START, INDEX_END = "<!-- index: python tests/test_docs.py writes it -->", "<!-- end of index -->"
# result files whose name is not their script's
WRITTEN_BY = {
    "dag_2xh200_stages.json": "make_run_stages",
    "dspark_vs_dflash_toy.json": "family_quality",
    "engine_side_by_side.json": "side_by_side",
    "train_side_by_side_qwen3-8b.json": "side_by_side",
    "plan_production.json": None,
}  # None: the planner, `python -m flashdraft.plan --json`
USAGE = re.compile(r"^\s*(?:Usage: )?(python benchmarks/\S+\.py.*)$", re.M)


def bench_scripts() -> list[str]:
    """The runnable benchmark scripts: the files of benchmarks/ with a __main__ block; the others (shapes.py,
    harness.py, train_bench.py, ...) are modules they share."""
    return sorted(f.stem for f in BENCH.glob("*.py") if '__name__ == "__main__"' in f.read_text())


def script_of(result: str, scripts: list[str]) -> str | None:
    """The script that writes `result` (None: the planner; "": none known)."""
    if result in WRITTEN_BY:
        return WRITTEN_BY[result]
    return max((s for s in scripts if result.startswith(s)), key=len, default="")


def bench_index() -> str:
    """One row per benchmark script: what it measures (its docstring's first sentence), its result files,
    who reads them (the planner's rates, docs pages) and its command line."""
    from flashdraft.estimate import RATES

    scripts = bench_scripts()
    results = sorted(f.name for f in (BENCH / "results").glob("*.json"))
    docs = {f.name: f.read_text() for f in sorted(DOCS.glob("*.md"))}
    rows = [
        "| script | measures | results (benchmarks/results/) | read by | command |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name in scripts + [None]:
        mine = [r for r in results if script_of(r, scripts) == name]
        rates = sorted(k for k, v in RATES.items() if v.file in mine)
        pages = [d for d, t in docs.items() if any(r in t for r in mine)]
        readers = [f"planner: {', '.join(f'`{k}`' for k in rates)}"] if rates else []
        readers += [f"[{d}](../docs/{d})" for d in pages]
        if name is None:
            what = "the planner's production plan"
            command = "`python -m flashdraft.plan --configfile config/production.yaml --json ...`"
        else:
            text = (BENCH / f"{name}.py").read_text()
            doc = ast.get_docstring(ast.parse(text)) or ""
            what = re.split(r"(?<=[a-z0-9)`])\.(?:\s|$)", " ".join(doc.split()), maxsplit=1)[0]
            usage = USAGE.search(doc)
            command = f"`{usage.group(1).strip()}`" if usage else f"`python benchmarks/{name}.py`"
        files = ", ".join(f"`{r}`" for r in mine) or "-"
        script = f"`{name}.py`" if name else "planner"
        rows.append(f"| {script} | {what} | {files} | {'; '.join(readers) or '-'} | {command} |")
    return "\n".join([INDEX_START, *rows, INDEX_END])


def test_the_benchmarks_index_is_what_the_scripts_and_results_say():
    """benchmarks/README.md's table names every script, every result file under the script that writes it,
    and who reads each: `python tests/test_docs.py` writes it again."""
    text = BENCH_README.read_text()
    assert INDEX_START in text and INDEX_END in text
    have = text[text.index(INDEX_START) : text.index(INDEX_END) + len(INDEX_END)]
    assert have == bench_index()
    scripts = bench_scripts()
    assert "train_drafter" in scripts and not {"shapes", "harness", "train_bench"} & set(scripts)
    orphans = [f.name for f in (BENCH / "results").glob("*.json") if script_of(f.name, scripts) == ""]
    assert not orphans, f"result files no script writes (name them in WRITTEN_BY): {orphans}"
    assert script_of("eval_decode_qwen3-8b_dspark_vs_dflash.json", scripts) == "eval_decode"
    assert script_of("made_up.json", scripts) == ""


def test_every_marked_figure_and_the_figures_table_are_the_results_files():
    """Each `VALUE<!--fig FILE KEY FORMAT-->` in README.md and docs/ equals its file's value, and
    docs/performance.md's table lists them: `python benchmarks/figures.py` writes them again."""
    texts, changed = figures.regenerate()
    assert not changed, changed
    assert any(figures.MARK.search(t) for p, t in texts.items() if p.name != "README.md")


def test_a_re_measured_figure_is_found_and_written(tmp_path, monkeypatch):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "tau 3.14<!--fig r.json eval.tau .2f--> in 2.5<!--fig r.json s /60--> min\n"
    )
    perf = f"speed {1.5:.1f}<!--fig r.json x.0.speed .1f-->x\n\n{figures.START}\n{figures.END}\n"
    (tmp_path / "docs" / "performance.md").write_text(perf)
    results_dir = tmp_path / "benchmarks" / "results"
    results_dir.mkdir(parents=True)
    (results_dir / "r.json").write_text(
        json.dumps(
            {
                "eval": {"tau": 3.1416},
                "s": 150,
                "x": [{"speed": 1.26}],
                "device": "cpu",
                "command": "python r.py",
            }
        )
    )
    monkeypatch.setattr(results, "CHECKOUT_RESULTS", results_dir)
    results.result.cache_clear()
    try:
        texts, changed = figures.regenerate(tmp_path, rates={})
    finally:
        results.result.cache_clear()
    assert changed == [
        "docs/performance.md: 1.5 -> 1.3 (r.json x.0.speed)",
        "docs/performance.md: the figures table",
    ]
    assert texts[tmp_path / "README.md"] == (tmp_path / "README.md").read_text()  # 3.14 and 150/60 = 2.5
    page = texts[tmp_path / "docs" / "performance.md"]
    assert page.startswith("speed 1.3<!--fig r.json x.0.speed .1f-->x")
    assert (
        "| `r.json` | cpu | not recorded | `python r.py` | `eval.tau` = 3.142 (README.md)<br>`s` = 150 "
        "(README.md)<br>`x.0.speed` = 1.26 (docs/performance.md) |" in page
    )


def figure_problem(tmp_path: Path, monkeypatch, marker: str) -> str:
    """What figures.regenerate reports for a README.md quoting `marker` (r.json: `eval` a dict, `s` 150)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(f"see {marker} here\n")
    (tmp_path / "docs" / "performance.md").write_text(f"{figures.START}\n{figures.END}\n")
    results_dir = tmp_path / "benchmarks" / "results"
    results_dir.mkdir(parents=True)
    (results_dir / "r.json").write_text(json.dumps({"eval": {"tau": 3.1416}, "s": 150}))
    monkeypatch.setattr(results, "CHECKOUT_RESULTS", results_dir)
    results.result.cache_clear()
    try:
        with pytest.raises(SystemExit) as e:
            figures.regenerate(tmp_path, rates={})
    finally:
        results.result.cache_clear()
    return str(e.value)


@pytest.mark.parametrize(
    "marker, why",
    [
        ("1<!--fig r.json s .zz-->", "format .zz"),
        ("1<!--fig r.json eval .2f-->", "a dict, not a number"),
        ("1<!--fig r.json s .1f/0-->", "divides by 0"),
        ("1<!--fig r.json s .1f*x-->", "format .1f*x"),
    ],
)
def test_a_bad_figure_marker_is_one_line_naming_the_doc_the_marker_and_why(
    tmp_path, monkeypatch, marker, why
):
    problem = figure_problem(tmp_path, monkeypatch, marker)
    assert len(problem.splitlines()) == 1, problem
    assert problem.startswith(f"README.md: {marker}: ") and why in problem, problem


# ---- config/*.yaml's comments cite result files, not measured figures ----

CONFIGS = REPO / "config"
# a measured figure: a number with a decimal point and a unit of speed, time, size or share ("1.36x",
# "86.0%", "10.4 s", "21.9 h", "18.0 TB", "12.6 GB", "12.2K tokens/s"); not a version ("2.13.0"), a
# learning rate ("1e-4", "1.0e-4") or a weight ("0.1 CE")
FIGURE = re.compile(
    r"(?<![\w.])\d[\d,]*\.\d+(?!\.\d)"
    r"(?:x(?![A-Za-z])|%| s\b| h\b| TB\b| GB\b|[KM]? ?tokens/s)"
)
COMMENT = re.compile(r"(?:^|\s)#(.*)$")


def comment_figures(text: str, where: str = "") -> list[str]:
    """The measured figures in the comments (the text after `#`) of a YAML file's lines."""
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        m = COMMENT.search(line)
        for fig in FIGURE.finditer(m.group(1) if m else ""):
            problems.append(f"{where}:{n}: {fig.group(0)!r} (cite its file under benchmarks/results/)")
    return problems


def test_config_comments_cite_result_files_not_numbers():
    """A measured figure in a config's comment goes stale when its benchmark runs again; the comment names
    the result file (and key) instead, and docs quote the figure through benchmarks/figures.py."""
    files = sorted(CONFIGS.glob("*.yaml"))
    assert files
    problems = [p for f in files for p in comment_figures(f.read_text(), str(f.relative_to(REPO)))]
    assert not problems, "\n".join(problems)


def test_a_figure_in_a_config_comment_is_found():
    text = (
        "train:\n"
        "  fp8: tensorwise   # 1.36x bf16's tokens/s on an H200\n"
        "  lr: 1.0e-4        # 1e-4 and 1.5e-4 tried; torch 2.13.0 on CUDA 12.8\n"
        "  gamma: 4.0        # 0.1 CE + 0.9 L1, 1.1M prompts, 2 TB, 3.14 samples\n"
        "# the plan: 21.9 h, 18.0 TB of hidden states, 12.6 GB checkpoints, a start of 10.4 s\n"
        "# 86.5% of the floor; regeneration at 12,246.6 tokens/s, 12.2K tokens/s per GPU\n"
        "path: results/run#1.5x\n"
    )
    problems = comment_figures(text, "c.yaml")
    found = [p.split("'")[1] for p in problems]
    assert found == [
        "1.36x",
        "21.9 h",
        "18.0 TB",
        "12.6 GB",
        "10.4 s",
        "86.5%",
        "12,246.6 tokens/s",
        "12.2K tokens/s",
    ], problems
    assert problems[0].startswith("c.yaml:2: '1.36x'")


if __name__ == "__main__":  # write the generated parts again
    text = CONFIG_DOC.read_text()
    CONFIG_DOC.write_text(text[: text.index("## Reference")] + reference(load_schema()))
    text = BENCH_README.read_text()
    if INDEX_START not in text:  # first time: after the opening paragraph
        head, rest = text.split("\n\n", 1)
        text = f"{head}\n\n{INDEX_START}\n{INDEX_END}\n\n{rest}"
    i, j = text.index(INDEX_START), text.index(INDEX_END) + len(INDEX_END)
    BENCH_README.write_text(text[:i] + bench_index() + text[j:])
