"""Tests follow modules: every module of flashdraft has its tests/test_<module>.py, or COVERED_BY names the
test files that test it (each imports it), or NO_LOGIC says why it has nothing to test."""

import ast
import pkgutil
from pathlib import Path

import flashdraft

TESTS = Path(__file__).resolve().parent
SRC = Path(flashdraft.__file__).resolve().parent

# module -> the test file (or files) that test it, for a module without a tests/test_<module>.py
COVERED_BY = {
    "config_check": "test_config.py",
    "drafter_io": ("test_model.py", "test_finetune.py"),  # export and load back; drafter.init_from
    "dspark_decode": "test_dspark.py",
    "errors": "test_user_errors.py",
    "estimate": "test_plan.py",
    "estimate_inputs": "test_plan.py",
    "float8": "test_config.py",
    "hf_config": ("test_config.py", "test_model.py"),  # reading config.json; plain_target_config
    "hidden_verify": ("test_hidden.py", "test_hidden_recovery.py"),
    "hidden_write": "test_hidden.py",
    "holdout": "test_validate.py",
    "io": ("test_console.py", "test_plan.py"),  # the console's status line; dtypes and byte counts
    "launch": "test_slurm.py",
    "objectives": "test_loss.py",
    "precompute": "test_hidden.py",
    "results": "test_plan.py",
    "sources": "test_prompts.py",
    "speculative": "test_evaluate.py",
    "step": "test_decode.py",
    "target": ("test_hidden.py", "test_model.py"),  # features and layers; load_target_head
    "timeline": "test_stream.py",
    "train_data": "test_stream.py",
    "train_setup": "test_batches.py",  # lr_factor; setup() runs in every training of test_train.py
    "train_step": "test_memory.py",
}

# module -> why it has no tests of its own: nothing in it but constants and re-exports
NO_LOGIC = {
    "shapes": "constants: target shapes by name, which test_plan.py, test_memory.py and test_disk.py read",
}


def modules() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules([str(SRC)]))


def imported(source: str) -> set[str]:
    """The flashdraft modules a test's source imports, anywhere in it: `from flashdraft.<m> import ...`,
    `import flashdraft.<m>`, `from flashdraft import <m>`."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "flashdraft":
                found |= {a.name for a in node.names}
            elif node.module.startswith("flashdraft."):
                found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[1] for a in node.names if a.name.startswith("flashdraft.")}
    return found


def has_logic(module: str) -> bool:
    """Whether a module defines anything that runs: a function, a class or a lambda."""
    tree = ast.parse((SRC / f"{module}.py").read_text())
    return any(
        isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef | ast.Lambda)
        for n in ast.walk(tree)
    )


def covering(module: str) -> tuple[str, ...]:
    files = COVERED_BY[module]
    return (files,) if isinstance(files, str) else files


def test_every_module_has_its_tests():
    problems = []
    for m in modules():
        own = TESTS / f"test_{m}.py"
        if own.exists():
            source = own.read_text()  # imported, or in the code of a process the test starts
            if m not in imported(source) and f"flashdraft.{m}" not in source:
                problems.append(f"{own.name} does not import flashdraft.{m}")
            if m in COVERED_BY or m in NO_LOGIC:
                problems.append(f"{m} has {own.name}: drop it from COVERED_BY / NO_LOGIC")
        elif m in COVERED_BY:
            for name in covering(m):
                path = TESTS / name
                if not path.exists():
                    problems.append(f"COVERED_BY[{m!r}]: no tests/{name}")
                elif m not in imported(path.read_text()):
                    problems.append(f"COVERED_BY[{m!r}]: tests/{name} does not import flashdraft.{m}")
        elif m in NO_LOGIC:
            if has_logic(m):
                problems.append(f"NO_LOGIC[{m!r}]: {m}.py defines functions or classes: test it")
        else:
            problems.append(
                f"{m}: no tests/test_{m}.py; write it, or name the test file that tests it in COVERED_BY"
            )
    assert not problems, "\n".join(problems)


def test_the_map_names_modules_and_reasons():
    mods = set(modules())
    assert len(mods) > 50 and {"model", "train", "chat_client"} <= mods
    assert not (COVERED_BY.keys() | NO_LOGIC.keys()) - mods
    assert not COVERED_BY.keys() & NO_LOGIC.keys()
    assert all(
        covering(m) and all(f.startswith("test_") and f.endswith(".py") for f in covering(m))
        for m in COVERED_BY
    )
    assert all(reason.strip() for reason in NO_LOGIC.values())


def test_imports_are_read_in_every_form():
    source = (
        "import os\n"
        "import flashdraft.model\n"
        "from flashdraft.loss import dflash_loss\n"
        "from flashdraft import chat, toy as t\n"
        "from . import helpers\n"
        "def f():\n"
        "    from flashdraft.float8.x import y\n"
    )
    assert imported(source) == {"model", "loss", "chat", "toy", "float8"}
    assert imported("import flashdraft\nfrom flashdraft_other import x\n") == set()


def test_logic_is_a_function_or_a_class():
    assert not has_logic("shapes")
    assert has_logic("parallel") and has_logic("proposer") and has_logic("chat_client")
