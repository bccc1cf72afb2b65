"""The layout's rules, read from the source with `ast`: no import cycles between our modules, dependencies point one
way (rl -> rollout -> quant; m3, the shared model definition, and quant import none of the others), a function-local
import of our own modules says why on its line, the trainer model imports without vLLM, files stay short."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rl", "rollout", "quant", "m3")
MAY_IMPORT = {"rl": {"rl", "rollout", "quant", "m3"}, "rollout": {"rollout", "quant", "m3"}, "quant": {"quant"},
              "m3": {"m3"}}
MAX_LINES = 520  # "every file under ~500 lines"


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for f in sorted((ROOT / pkg).rglob("*.py")):
            parts = f.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    return out


def _imports(path: Path, modules) -> list[tuple[str, int, bool]]:
    """(imported module of ours, line, inside a function) for every import statement in the file."""
    tree = ast.parse(path.read_text())
    local = {id(n) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for n in ast.walk(fn)}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from pkg import sub` imports the submodule pkg.sub when there is one, else a name of pkg
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                     for a in node.names]
        else:
            continue
        out += [(n, node.lineno, id(node) in local) for n in names if n.split(".")[0] in PACKAGES]
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {m: {n for n, _, _ in _imports(f, modules) if n in modules and n != m} for m, f in modules.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    assert _cycles(_graph()) == []


def test_cycle_finder_finds_a_cycle():  # the check above must be able to fail
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_dependencies_point_one_way():
    breaks = [f"{m} imports {n}" for m, deps in _graph().items() for n in deps
              if n.split(".")[0] not in MAY_IMPORT[m.split(".")[0]]]
    assert breaks == []


def test_function_local_imports_of_our_modules_say_why():
    modules = _modules()
    silent = []
    for m, f in modules.items():
        lines = f.read_text().splitlines()
        silent += [f"{f.relative_to(ROOT)}:{line}" for _, line, local in _imports(f, modules)
                   if local and "#" not in lines[line - 1]]
    assert silent == []


def test_trainer_model_and_config_import_without_vllm():
    code = ("import sys, rl.model, rl.config, rl.algorithm, rl.data, rl.model.fsdp, m3.tiny; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'vllm'))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_files_stay_short():
    long = [f"{f.relative_to(ROOT)}: {n}" for f in sorted(ROOT.glob("*/**/*.py"))
            if f.parts[len(ROOT.parts)] in (*PACKAGES, "scripts")
            and (n := len(f.read_text().splitlines())) > MAX_LINES]
    assert long == []
