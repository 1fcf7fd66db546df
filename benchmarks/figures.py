"""Every measured figure the docs quote, written from the committed results and listed with its source.

Each `VALUE<!--fig FILE KEY FORMAT-->` in README.md and docs/*.md is the value at KEY (dotted; in double
quotes when it holds spaces) of benchmarks/results/FILE, in FORMAT (a Python format spec, optionally
followed by `*N` or `/N`, e.g. `.2f`, `,.0f`, `.1f/3600`; default `.3g`), and docs/performance.md's last
section lists every figure by its file, with the device, commit and command the file records, the
planner's rates among them.

Usage: python benchmarks/figures.py [--check]
(--check: write nothing, list the figures that differ from their files and exit 1 if any does)
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from flashdraft.errors import UserError  # noqa: E402
from flashdraft.estimate import RATES  # noqa: E402
from flashdraft.results import figure, provenance  # noqa: E402

# a number not inside another (the 40 of "16-40" is not -40); a key with spaces in double quotes
MARK = re.compile(
    r"(?<![\w.])(?P<value>[-+]?\d[\d,]*(?:\.\d+)?%?)"
    r'<!--fig (?P<file>\S+) (?:"(?P<qkey>[^"]+)"|(?P<key>\S+))(?: (?P<fmt>\S+))?-->'
)
TABLE_DOC = "docs/performance.md"
START, END = "<!-- figures: python benchmarks/figures.py writes it -->", "<!-- end of figures -->"


def docs(repo: Path = REPO) -> list[Path]:
    return [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]


def number(value) -> float | int:
    """A figure as a number: a file's text ("12.5") read as one; anything else (a dict, a list) an error."""
    if isinstance(value, str):
        try:
            return float(value)  # a figure some files keep as text
        except ValueError:
            raise UserError(f"the value {value!r} is not a number") from None
    if not isinstance(value, (int, float)):
        raise UserError(f"the value is a {type(value).__name__}, not a number")
    return value


def split_format(fmt: str) -> tuple[str, str | None, float | None]:
    """FORMAT as its Python format spec and its `*N` or `/N` (None, None: neither)."""
    m = re.fullmatch(r"([^*/]*)(?:([*/])([\d.e+-]+))?", fmt)
    try:
        n = float(m[3]) if m and m[2] else None
    except ValueError:  # a factor float() cannot read ("1..2")
        m = None
    if m is None:
        raise UserError(f"format {fmt}: not SPEC, SPEC*N or SPEC/N (N a number)")
    if m[2] == "/" and n == 0:
        raise UserError(f"format {fmt}: divides by 0")
    return m[1], m[2], n


def render(value, fmt: str | None) -> str:
    value, (spec, op, n) = number(value), split_format(fmt or ".3g")
    value = value * n if op == "*" else value / n if op else value
    try:
        return format(value, spec)
    except ValueError as e:  # not a format spec (".zz")
        raise UserError(f"format {fmt}: {e}") from None


def rewrite(text: str, where: str) -> tuple[str, list[str], list[tuple[str, str]]]:
    """The text with every marked figure written from its file; what changed; the (file, key) quoted."""
    changed, quoted = [], []

    def one(m: re.Match) -> str:
        key = m["qkey"] or m["key"]
        try:
            new = render(figure(m["file"], key), m["fmt"])
        except UserError as e:
            raise SystemExit(f"{where}: {m.group(0)}: {e}") from None
        if new != m["value"]:
            changed.append(f"{where}: {m['value']} -> {new} ({m['file']} {key})")
        quoted.append((m["file"], key))
        return new + m.group(0)[len(m["value"]) :]

    return MARK.sub(one, text), changed, quoted


def table(quoted: dict[tuple[str, str], list[str]], rates: dict) -> str:
    """One row per result file: where the file says it was measured (device, commit, command) and each
    of its figures (key = value) with the pages (or the planner's rate) quoting it."""
    for name, r in rates.items():
        quoted.setdefault((r.file, r.key), []).append(f"planner `{name}`")
    by_file: dict[str, list[str]] = {}
    for (file, key), where in sorted(quoted.items()):
        value = figure(file, key)
        shown = (
            render(value, ",.0f" if abs(value) >= 1000 else ".4g")
            if isinstance(value, (int, float))
            else str(value)
        )
        by_file.setdefault(file, []).append(f"`{key}` = {shown} ({', '.join(dict.fromkeys(where))})")
    rows = [
        "| file (benchmarks/results/) | device | commit | command | figures (where quoted) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for file, figs in by_file.items():
        p = {k: v or "not recorded" for k, v in provenance(file).items()}
        command = f"`{p['command']}`" if p["command"] != "not recorded" else p["command"]
        rows.append(f"| `{file}` | {p['device']} | {p['commit']} | {command} | {'<br>'.join(figs)} |")
    return "\n".join([START, *rows, END])


def regenerate(repo: Path = REPO, rates: dict = RATES) -> tuple[dict[Path, str], list[str]]:
    """Every doc's text with its figures and the figures table (with the planner's `rates`) written
    again, and what changed."""
    out, changed, quoted = {}, [], {}
    for path in docs(repo):
        rel = str(path.relative_to(repo))
        text, diff, q = rewrite(path.read_text(), rel)
        out[path], changed = text, changed + diff
        for fk in q:
            quoted.setdefault(fk, []).append(rel)
    perf = repo / TABLE_DOC
    text = out[perf]
    if START not in text or END not in text:
        raise SystemExit(f"{TABLE_DOC}: no {START} ... {END} section for the figures table")
    i, j = text.index(START), text.index(END) + len(END)
    new = text[:i] + table(quoted, rates) + text[j:]
    if new != text:
        changed.append(f"{TABLE_DOC}: the figures table")
    out[perf] = new
    return out, changed


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a figure differs")
    args = p.parse_args()
    texts, changed = regenerate()
    print("\n".join(changed) or "every figure is its file's")
    if args.check:
        sys.exit(1 if changed else 0)
    for path, text in texts.items():
        if path.read_text() != text:
            path.write_text(text)


if __name__ == "__main__":
    main()
