"""docs/architecture.md against the code: its module table names every module of src/flashdraft, and its
import table lists each module's imports of other flashdraft modules exactly as the code has them, in
layers that no import climbs, without cycles.

`python tests/test_architecture.py` prints the import table as the code has it, each module at the lowest
layer the rule allows, for pasting into the doc.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PKG = REPO / "src" / "flashdraft"
DOC = REPO / "docs" / "architecture.md"

# Imports that climb a layer today, each with its reason. The list may only shrink: a new climbing import
# fails the test, and so does an entry here that no longer climbs.
KNOWN_CLIMBING: set[tuple[str, str]] = set()


def package_modules() -> list[str]:
    return sorted(p.stem for p in PKG.glob("*.py") if p.stem != "__init__")


def _imported(node: ast.AST, modules: set[str]) -> set[str]:
    """The flashdraft modules one import statement names: `from .x import`, `from . import x`,
    `from flashdraft.x import`, `from flashdraft import x`, `import flashdraft.x`."""
    if isinstance(node, ast.Import):
        parts = [alias.name.split(".") for alias in node.names]
        return {p[1] for p in parts if p[0] == "flashdraft" and len(p) > 1}
    if not isinstance(node, ast.ImportFrom):
        return set()
    if node.level == 1:
        path = node.module.split(".") if node.module else []
    elif node.level == 0 and node.module and node.module.split(".")[0] == "flashdraft":
        path = node.module.split(".")[1:]
    else:
        return set()
    if path:
        return {path[0]}
    return {alias.name for alias in node.names if alias.name in modules}


def code_imports(module: str) -> tuple[set[str], set[str]]:
    """(module-level imports, imports found only inside functions) of one module: the other flashdraft
    modules it names. Module level is everything outside a function body (class bodies, `if` and `try`
    blocks included)."""
    modules = set(package_modules())
    tree = ast.parse((PKG / f"{module}.py").read_text(), filename=f"{module}.py")
    top: set[str] = set()
    inner: set[str] = set()

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
                continue  # imports nothing when the code runs
            nested = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            (inner if nested else top).update(_imported(child, modules))
            visit(child, nested)

    visit(tree, False)
    top.discard(module)
    return top, inner - top - {module}


def _section(title: str) -> list[str]:
    """The lines of the doc's section `## title`, up to the next `## ` heading."""
    lines = DOC.read_text().splitlines()
    start = lines.index(f"## {title}") + 1
    end = next((i for i in range(start, len(lines)) if lines[i].startswith("## ")), len(lines))
    return lines[start:end]


def _table(title: str) -> list[list[str]]:
    """The body rows of the first table in a section, as lists of cells."""
    rows = []
    for line in _section(title):
        if line.startswith("|"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split("|")])
        elif rows:
            break
    assert len(rows) > 2, f"docs/architecture.md: no table under '## {title}'"
    return rows[2:]  # header and separator


def _names(cell: str) -> set[str]:
    return set(re.findall(r"`(\w+)`", cell))


def doc_imports() -> dict[str, tuple[int, set[str], set[str]]]:
    """The import table: module -> (layer, module-level imports, imports only in functions)."""
    table: dict[str, tuple[int, set[str], set[str]]] = {}
    for cells in _table("Imports"):
        assert len(cells) == 4, f"docs/architecture.md, import table: row {cells} needs 4 cells"
        layer, module, top, inner = cells
        name = module.strip("`")
        assert name not in table, f"docs/architecture.md, import table: `{name}` has two rows"
        table[name] = (int(layer), _names(top), _names(inner))
    return table


def _differences(what: str, module: str, code: set[str], doc: set[str]) -> list[str]:
    out = []
    if code - doc:
        out.append(f"`{module}` {what}: the code imports {sorted(code - doc)}, the table does not list them")
    if doc - code:
        out.append(f"`{module}` {what}: the table lists {sorted(doc - code)}, the code does not import them")
    return out


def test_module_table_names_every_module():
    doc = [cells[0].strip("`") for cells in _table("Modules")]
    code = package_modules()
    assert len(doc) == len(set(doc)), f"docs/architecture.md, module table: a module has two rows: {doc}"
    lacking, extra = sorted(set(code) - set(doc)), sorted(set(doc) - set(code))
    assert not lacking, f"docs/architecture.md, module table lacks {lacking}"
    assert not extra, f"docs/architecture.md, module table names {extra}, which src/flashdraft does not have"


def test_import_table_matches_the_code():
    doc = doc_imports()
    code = package_modules()
    problems = [f"`{m}`: no row in the import table" for m in code if m not in doc]
    problems += [f"`{m}`: in the import table, not in src/flashdraft" for m in doc if m not in code]
    for module in code:
        if module in doc:
            top, inner = code_imports(module)
            _, doc_top, doc_inner = doc[module]
            problems += _differences("at module level", module, top, doc_top)
            problems += _differences("only in functions", module, inner, doc_inner)
    assert not problems, "docs/architecture.md's import table is stale:\n" + "\n".join(problems)


def test_no_import_cycles_at_module_level():
    graph = {m: code_imports(m)[0] for m in package_modules()}
    done: set[str] = set()

    def walk(module: str, path: list[str]) -> None:
        if module in path:
            cycle = path[path.index(module) :] + [module]
            raise AssertionError("import cycle at module level: " + " -> ".join(cycle))
        if module in done:
            return
        for imported in sorted(graph[module]):
            walk(imported, path + [module])
        done.add(module)

    for module in graph:
        walk(module, [])


def test_no_import_climbs_a_layer():
    """Every import, at module level or in a function, names a module of a lower layer, but for
    KNOWN_CLIMBING (function-level imports only)."""
    layers = {m: layer for m, (layer, _, _) in doc_imports().items()}
    problems, climbing = [], set()
    for module in package_modules():
        top, inner = code_imports(module)
        for imported, where in [(i, "at module level") for i in sorted(top)] + [
            (i, "in a function") for i in sorted(inner)
        ]:
            if module not in layers or imported not in layers or layers[imported] < layers[module]:
                continue
            if where == "in a function" and (module, imported) in KNOWN_CLIMBING:
                climbing.add((module, imported))
                continue
            problems.append(
                f"`{module}` (layer {layers[module]}) imports `{imported}` (layer {layers[imported]}) {where}"
            )
    problems += [
        f"KNOWN_CLIMBING has {pair}, which no longer climbs: remove it"
        for pair in sorted(KNOWN_CLIMBING - climbing)
    ]
    assert not problems, "\n".join(problems)


def lowest_layers() -> dict[str, int]:
    """Each module's lowest layer under the rule: one above everything it imports (KNOWN_CLIMBING aside)."""
    graph = {}
    for m in package_modules():
        top, inner = code_imports(m)
        graph[m] = {i for i in top | inner if (m, i) not in KNOWN_CLIMBING}
    layers: dict[str, int] = {}

    def layer(m: str) -> int:
        if m not in layers:
            layers[m] = 1 + max((layer(i) for i in graph[m]), default=-1)
        return layers[m]

    for m in graph:
        layer(m)
    return layers


def _cell(names: set[str]) -> str:
    return ", ".join(f"`{n}`" for n in sorted(names)) or "—"


if __name__ == "__main__":
    print("| layer | module | imports at module level | imports only in functions |")
    print("| --- | --- | --- | --- |")
    layers = lowest_layers()
    for m in sorted(layers, key=lambda m: (layers[m], m)):
        top, inner = code_imports(m)
        print(f"| {layers[m]} | `{m}` | {_cell(top)} | {_cell(inner)} |")


def rule_scripts() -> dict[str, str]:
    """Each workflow rule (or checkpoint) and the script its `stage(...)` runs."""
    out = {}
    for smk in sorted((REPO / "workflow" / "rules").glob("*.smk")):
        text = smk.read_text()
        starts = list(re.finditer(r"^\s*(?:rule|checkpoint) (\w+):", text, re.M))
        for m, nxt in zip(starts, [*starts[1:], None], strict=False):
            body = text[m.end() : nxt.start() if nxt else len(text)]
            script = re.search(r'stage\("(\w+)\.py"', body)
            if script:
                out[m.group(1)] = script.group(1)
    return out


def test_each_rule_runs_the_script_of_its_name():
    """rule X runs scripts/X.py; a rule for a part of a stage (its stream chunks, its validation split)
    names the stage's script with the part's word: hidden_chunk_verify runs hidden_verify.py."""
    scripts = rule_scripts()
    assert {
        "prompts",
        "regenerate",
        "hidden_shard",
        "hidden_verify",
        "warmup",
        "train",
        "evaluate",
        "report",
        "data_plan",
        "train_chunk",
    } <= set(scripts), scripts
    for rule, script in scripts.items():
        assert (REPO / "scripts" / f"{script}.py").is_file(), (rule, script)
        assert script in (rule, rule.replace("_chunk", "").replace("_val", "")), (rule, script)


# Each hidden-state mode's files: its functions (the mode interface) and its rules.
MODE_FILES = {"store": ("store_mode.smk", "hidden.smk"), "stream": ("stream_mode.smk", "stream.smk")}


def mode_interface(smk: Path) -> list[str]:
    """The mode interface a mode's functions file names at its top, one `#   name()  what it is` a line."""
    return re.findall(r"^#   (\w+)(?:\(\))? ", smk.read_text(), re.M)


def test_only_the_mode_files_know_the_hidden_state_mode():
    """Both modes' functions files name the same mode interface and define all of it; no other rule file
    tests hidden.mode (the Snakefile includes one mode's files)."""
    rules = REPO / "workflow" / "rules"
    store, stream = (mode_interface(rules / MODE_FILES[m][0]) for m in ("store", "stream"))
    assert store == stream and len(store) > 5, (store, stream)
    for functions, _ in MODE_FILES.values():
        defined = set(re.findall(r"^def (\w+)\(", (rules / functions).read_text(), re.M))
        assert set(store) <= defined, (functions, set(store) - defined)
    own = {name for files in MODE_FILES.values() for name in files}
    for smk in sorted(rules.glob("*.smk")):
        if smk.name not in own:
            assert not re.search(r"\bSTREAM\b|\.mode\b", smk.read_text()), smk.name
