"""Does a vLLM source tree still have everything our code imports, patches, calls and overrides?

Uses are collected from our source with `ast` (`collect_uses`): vllm imports, attribute chains on names bound to
vLLM modules or classes (stores are patches), calls through them (keyword names and positional counts), methods our
subclasses of vLLM classes override, functions we install in place of vLLM's (compared parameter by parameter), and
`getattr`/`setattr` over a constant tuple of names. What `ast` cannot see (attributes of objects vLLM hands us:
`self.model_runner.lora_manager._adapter_manager`) comes from the hand list `vllm_api_hand_list.toml`.
`check(index, uses)` answers per symbol: ok / missing / signature mismatch, plus a fingerprint for comparing releases.

    python scripts/install/check_vllm_api.py [--vllm-src DIR]   # default: the installed vllm's source
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import json
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling module, also when loaded by path (tests)
from vllm_source_index import (  # noqa: E402
    TRANSPARENT_DUNDERS,
    Param,  # noqa: F401  (re-exported: tests build signatures through this module)
    call_problems,
    Signature,
    SourceIndex,
    Symbol,
    dotted,
    fingerprint,
    override_problems,
    signature_of,
)

ROOT = Path(__file__).resolve().parents[2]
HAND_LIST = Path(__file__).resolve().parent / "vllm_api_hand_list.toml"
# rollout/ is what runs inside vLLM; the rest is marked by where it lives (tests/scripts may use vLLM differently).
SCANNED = ("rollout", "rl", "scripts", "tests", "quant", "m3")


@dataclass
class Use:
    path: str
    kind: str  # import | attr | patch | call | override | hand
    where: str
    role: str  # rollout | rl | scripts | tests | ... (top-level folder of the using file)
    positional: int = 0
    keywords: list[str] = field(default_factory=list)
    splat: bool = False  # the call passes *args / **kwargs: only the names it spells out are checked
    bound: bool = False  # called on an instance (hand list): the first parameter is already bound
    unbound: bool = False  # called through `__func__`: a classmethod gets `cls` passed explicitly
    ours: Signature | None = None  # override: our function's signature, compared with vLLM's
    only: frozenset[str] | None = None  # under `if vllm_release() == "X"`: used on these releases only
    never: frozenset[str] = frozenset()  # in that `if`'s else branch

    def applies_to(self, release: str) -> bool:
        return (self.only is None or release in self.only) and release not in self.never
    note: str = ""


# -- collecting uses from our source ----------------------------------------------------------------------------
class _FileScanner(ast.NodeVisitor):
    """One file: scopes map local names to vLLM dotted paths (imports and `x = vllm_thing` assignments)."""

    def __init__(self, path: Path, role: str, ours: dict[str, ast.Module]):
        self.rel, self.role, self.ours = str(path.relative_to(ROOT)), role, ours
        self.tree = ours.get(self.rel) or ast.parse(path.read_text())
        self.scopes: list[dict[str, str]] = [{}]
        self.defs: list[dict[str, ast.AST]] = [{}]  # functions/classes defined per scope (for overrides)
        self.uses: list[Use] = []
        self.release_guards: list[tuple[frozenset[str] | None, frozenset[str]]] = []
        self.our_modules: dict[str, str] = {}  # local alias -> our module's dotted name (rollout.plugin.x)
        self.constants = {t.id: s.value for s in self.tree.body if isinstance(s, ast.Assign)
                          for t in s.targets if isinstance(t, ast.Name)}

    def use(self, path, kind, node, **kw):
        path = path.replace(".__func__", "")
        only = [g for g, _ in self.release_guards if g is not None]
        never = frozenset(r for _, n in self.release_guards for r in n)
        self.uses.append(Use(path, kind, f"{self.rel}:{node.lineno}", self.role, **kw,
                             only=frozenset.intersection(*only) if only else None, never=never))

    def visit_If(self, node):
        """`if vllm_release() == "0.32.0":` / `in (...)`: code written for some releases only."""
        releases = _release_test(node.test)
        if releases is None:
            self.generic_visit(node)
            return
        self.visit(node.test)
        for guard, body in (((releases, frozenset()), node.body), ((None, releases), node.orelse)):
            self.release_guards.append(guard)
            for stmt in body:
                self.visit(stmt)
            self.release_guards.pop()

    def lookup(self, expr) -> str | None:
        name = dotted(expr)
        if not name:
            return None
        head, _, rest = name.partition(".")
        for scope in reversed(self.scopes):
            if head in scope:
                # `__func__` is kept: a call through it passes `cls` itself (see visit_Call)
                parts = [scope[head], *[p for p in rest.split(".")
                                        if p and (p not in TRANSPARENT_DUNDERS or p == "__func__")]]
                return ".".join(parts)
        return None

    def bind(self, name, target):
        self.scopes[-1][name] = target

    # imports
    def visit_Import(self, node):
        for a in node.names:
            if a.name.split(".")[0] == "vllm":
                self.use(a.name, "import", node)
                self.bind(a.asname or "vllm", a.name if a.asname else "vllm")

    def visit_ImportFrom(self, node):
        if node.level == 0 and node.module and node.module.split(".")[0] == "vllm":
            for a in node.names:
                self.use(f"{node.module}.{a.name}", "import", node)
                self.bind(a.asname or a.name, f"{node.module}.{a.name}")
        elif node.level == 0 and node.module and node.module.split(".")[0] in SCANNED:
            for a in node.names:
                self.our_modules[a.asname or a.name] = f"{node.module}.{a.name}"

    # scopes
    def _scoped(self, node):
        self.defs[-1][node.name] = node
        self.scopes.append({})
        self.defs.append({})
        self.generic_visit(node)
        self.scopes.pop()
        self.defs.pop()

    def visit_FunctionDef(self, node):
        self._scoped(node)

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_ClassDef(self, node):
        for b in node.bases:
            target = self.lookup(b)
            if target:
                self.use(target, "attr", node)
        self._scoped(node)

    # attribute chains (loads and stores)
    def visit_Attribute(self, node):
        target = self.lookup(node)
        if target and "." in target:
            self.use(target, "patch" if isinstance(node.ctx, ast.Store) else "attr", node)
        else:
            self.generic_visit(node)

    def visit_Assign(self, node):
        self.visit(node.value)
        for t in node.targets:
            self.visit(t)
            target = self.lookup(t) if isinstance(t, ast.Attribute) else None
            if target:
                self._replacement(target, node.value, node)
        source = self.lookup(node.value)
        if source and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            self.bind(node.targets[0].id, source)  # `select = method.select_unquantized_moe_backend`

    def _replacement(self, target: str, value, node):
        """`vllm.x.f = ours`: compare our function's parameters with vLLM's."""
        wrapper = ""
        if isinstance(value, ast.Call) and dotted(value.func) in ("classmethod", "staticmethod") and value.args:
            wrapper, value = dotted(value.func), value.args[0]
        fn = self._our_function(value)
        if fn is not None:
            sig = signature_of(fn)
            sig.decorator = wrapper or sig.decorator
            self.use(target, "override", node, ours=sig, note=f"replaced by {fn.name}")

    def _our_function(self, value):
        if isinstance(value, ast.Name):
            for defs in reversed(self.defs):
                if isinstance(defs.get(value.id), (ast.FunctionDef, ast.AsyncFunctionDef)):
                    return defs[value.id]
            return None
        name = dotted(value)
        if name and "." in name:
            head, _, attr = name.rpartition(".")
            module = self.our_modules.get(head)
            tree = self._our_tree(module) if module else None
            for stmt in tree.body if tree else ():
                if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == attr:
                    return stmt
        return None

    def _our_tree(self, module: str) -> ast.Module | None:
        rel = str(Path(*module.split(".")).with_suffix(".py"))
        if rel not in self.ours and (ROOT / rel).is_file():
            self.ours[rel] = ast.parse((ROOT / rel).read_text())
        return self.ours.get(rel)

    # calls
    def visit_Call(self, node):
        target = self.lookup(node.func)
        if not target:
            self.generic_visit(node)
            return
        self.use(target, "call", node, positional=sum(not isinstance(a, ast.Starred) for a in node.args),
                 keywords=[k.arg for k in node.keywords if k.arg], unbound=target.endswith(".__func__"),
                 splat=any(isinstance(a, ast.Starred) for a in node.args) or any(k.arg is None for k in node.keywords))
        for child in [*node.args, *node.keywords]:
            self.visit(child)

    def visit_For(self, node):
        """`for name in CONSTANT_NAMES: getattr(vllm_thing, name)` / `setattr(vllm_thing, name, ours)`."""
        names = self._constant_strings(node.iter)
        if names and isinstance(node.target, ast.Name):
            for call in ast.walk(node):
                if (isinstance(call, ast.Call) and dotted(call.func) in ("getattr", "setattr") and len(call.args) >= 2
                        and isinstance(call.args[1], ast.Name) and call.args[1].id == node.target.id):
                    owner = self.lookup(call.args[0])
                    for n in names if owner else ():
                        self.use(f"{owner}.{n}", "patch" if call.func.id == "setattr" else "attr", call)
                        if call.func.id == "setattr" and len(call.args) == 3:
                            repl = call.args[2]
                            if isinstance(repl, ast.Call) and dotted(repl.func) == "getattr":
                                fn = self._our_function(ast.Attribute(repl.args[0], n, ast.Load()))
                                if fn is not None:
                                    self.use(f"{owner}.{n}", "override", call, ours=signature_of(fn),
                                             note=f"replaced by {dotted(repl.args[0])}.{n}")
        self.generic_visit(node)

    def _constant_strings(self, expr) -> list[str]:
        value = None
        if isinstance(expr, ast.Name):
            value = self.constants.get(expr.id)
        elif isinstance(expr, ast.Attribute) and dotted(expr.value) in self.our_modules:
            tree = self._our_tree(self.our_modules[dotted(expr.value)])
            value = next((s.value for s in (tree.body if tree else ()) if isinstance(s, ast.Assign)
                          for t in s.targets if isinstance(t, ast.Name) and t.id == expr.attr), None)
        if isinstance(value, (ast.Tuple, ast.List)) and all(
                isinstance(e, ast.Constant) and isinstance(e.value, str) for e in value.elts):
            return [e.value for e in value.elts]
        return []


def _release_test(test) -> frozenset[str] | None:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.left, ast.Call)
            and dotted(test.left.func) in ("vllm_release", "registry.vllm_release")):
        return None
    right = test.comparators[0]
    if isinstance(test.ops[0], ast.Eq) and isinstance(right, ast.Constant):
        return frozenset([right.value])
    if isinstance(test.ops[0], ast.In) and isinstance(right, (ast.Tuple, ast.List, ast.Set)):
        return frozenset(e.value for e in right.elts if isinstance(e, ast.Constant))
    return None


def _class_overrides(scanners: list[_FileScanner], index: SourceIndex) -> list[Use]:
    """Methods of our classes (in any file) that override a method of a vLLM base class."""
    classes: dict[str, tuple[_FileScanner, ast.ClassDef]] = {}
    for sc in scanners:
        module = sc.rel.removesuffix(".py").replace("/", ".")
        for node in ast.walk(sc.tree):
            if isinstance(node, ast.ClassDef):
                classes[f"{module}.{node.name}"] = (sc, node)
                classes.setdefault(node.name, (sc, node))

    def our_class(sc, name: str) -> str:
        """A base class name as written in `sc` -> its key in `classes` (module-qualified where imported)."""
        head, _, attr = name.rpartition(".")
        return f"{sc.our_modules[head]}.{attr}" if head in sc.our_modules else sc.our_modules.get(name, name)

    def our_chain(sc, node, seen) -> list[ast.ClassDef]:
        out = [node]
        for b in node.bases:
            key = our_class(sc, dotted(b) or "")
            if key in classes and key not in seen:
                seen.add(key)
                out += our_chain(*classes[key], seen)
        return out

    def vllm_bases(sc, node, seen) -> list[str]:
        out = []
        for b in node.bases:
            name = dotted(b)
            vllm_path = _file_binding(sc, name)
            if vllm_path:
                out.append(vllm_path)
            elif name:
                key = our_class(sc, name)
                if key in classes and key not in seen:
                    seen.add(key)
                    out += vllm_bases(*classes[key], seen)
        return out

    uses = []
    for key, (sc, node) in classes.items():
        if "." not in key:
            continue
        bases = [s for s in (index.resolve(p) for p in vllm_bases(sc, node, set())) if s and s.kind == "class"]
        for fn in node.body:
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for base in bases:
                theirs = index.member(base, fn.name)
                if theirs is not None and theirs.kind == "function":
                    uses.append(Use(theirs.path, "override", f"{sc.rel}:{fn.lineno}", sc.role,
                                    ours=signature_of(fn), note=f"overridden by {node.name}.{fn.name}"))
                    break
        if bases:
            uses += _inherited_attribute_uses(sc, node, our_chain(sc, node, set()), bases, index)
    return uses


def _inherited_attribute_uses(sc, node: ast.ClassDef, chain: list[ast.ClassDef], bases: list[Symbol],
                              index: SourceIndex) -> list[Use]:
    """`self.x` that our subclass reads but neither it nor our other classes define: vLLM's base must have it."""
    ours = set()
    for cls in chain:
        for stmt in cls.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                ours.add(stmt.name)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                ours |= {t.id for t in (stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target])
                         if isinstance(t, ast.Name)}
        ours |= {n.attr for n in ast.walk(cls) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                 and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls")}
    uses, seen = [], set()
    for fn in node.body:
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) or not fn.args.args:
            continue
        me = fn.args.args[0].arg
        for n in ast.walk(fn):
            if (isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Load) and isinstance(n.value, ast.Name)
                    and n.value.id == me and n.attr not in ours and n.attr not in seen
                    and not n.attr.startswith("__")):
                seen.add(n.attr)
                owner = next((b for b in bases if index.member(b, n.attr) is not None), bases[0])
                sym = index.member(owner, n.attr)
                uses.append(Use(sym.path if sym else f"{owner.path}.{n.attr}", "attr", f"{sc.rel}:{n.lineno}",
                                sc.role, note=f"{me}.{n.attr} in {node.name}.{fn.name}"))
    return uses


def _file_binding(sc: _FileScanner, name: str | None) -> str | None:
    if not name:
        return None
    head, _, rest = name.partition(".")
    for scope in sc.scopes:  # only the module scope survives the visit: imports there or function-local ones
        if head in scope:
            return scope[head] + (f".{rest}" if rest else "")
    for node in ast.walk(sc.tree):  # function-local `from vllm... import X` of a base class
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("vllm"):
            for a in node.names:
                if (a.asname or a.name) == head:
                    return f"{node.module}.{a.name}" + (f".{rest}" if rest else "")
    return None


def hand_uses(path: Path = HAND_LIST) -> list[Use]:
    data = tomllib.loads(path.read_text())
    out = []
    for e in data.get("symbol", []):
        call = e.get("call")
        out.append(Use(e["path"], "call" if call is not None else "hand", e["where"], e.get("role", "rollout"),
                       positional=(call or {}).get("positional", 0), keywords=(call or {}).get("keywords", []),
                       bound=(call or {}).get("bound", False), note="hand list"))
    return out


def collect_uses(index: SourceIndex, roots: tuple[str, ...] = SCANNED, hand_list: Path = HAND_LIST) -> list[Use]:
    ours: dict[str, ast.Module] = {}
    scanners = []
    for top in roots:
        for f in sorted((ROOT / top).rglob("*.py")):
            if "vllm" not in f.read_text():
                continue
            sc = _FileScanner(f, top, ours)
            sc.visit(sc.tree)
            scanners.append(sc)
    uses = [u for sc in scanners for u in sc.uses]
    return uses + _class_overrides(scanners, index) + hand_uses(hand_list)


# -- checking ---------------------------------------------------------------------------------------------------
def _callable_signature(index: SourceIndex, sym: Symbol, use: Use) -> Signature | None:
    if sym.kind == "class":
        return index.constructor(sym)
    sig = sym.signature
    if sig is None:
        return None
    bound = use.bound or sym.via_instance
    if (sig.decorator == "classmethod" and not use.unbound) or (bound and sig.decorator != "staticmethod"):
        return sig.drop_first()
    return sig


def check(index: SourceIndex, uses: list[Use]) -> dict[str, dict]:
    """Per vLLM symbol: status (ok | missing | mismatch), its definition, signature, fingerprint, and our uses."""
    out: dict[str, dict] = {}
    release = index.version()
    for use in uses:
        if not use.applies_to(release):
            entry = out.setdefault(use.path, {"status": "n/a", "kind": None, "defined_at": None, "signature": None,
                                              "fingerprint": "", "uses": [], "problems": []})
            entry["uses"].append(f"{use.kind} {use.where} [{use.role}] (not on {release})")
            continue
        sym = index.resolve(use.path)
        entry = out.get(use.path)
        if entry is not None and entry["status"] == "n/a":
            del out[use.path]  # also used where it applies: checked as usual
            entry = None
        entry = entry or out.setdefault(use.path, {
            "status": "ok", "kind": sym.kind if sym else None, "defined_at": sym.where if sym else None,
            "signature": str(sym.signature) if sym and sym.signature else None,
            "fingerprint": fingerprint(sym.node) if sym and sym.kind != "module" else "",
            "uses": [], "problems": []})
        entry["uses"].append(f"{use.kind} {use.where} [{use.role}]" + (f" ({use.note})" if use.note else ""))
        if sym is None:
            entry["status"] = "missing"
            continue
        if sym.kind in ("dynamic", "opaque"):
            entry["notes"] = ["not declared in vLLM's source (made at run time, or a member of a value)"]
        problems = []
        if use.kind == "call":
            sig = _callable_signature(index, sym, use)
            if sig is not None:
                problems = call_problems(sig, use)
            elif sym.kind == "class":
                entry.setdefault("notes", []).append("constructor not readable from vLLM's source (external base)")
        elif use.kind == "override" and use.ours is not None:
            theirs = sym.signature
            problems = (override_problems(theirs, use.ours) if theirs is not None
                        else [f"vLLM's {sym.kind} is not a function"])
        for p in problems:
            entry["problems"].append(f"{use.where}: {p}")
        if problems:
            entry["status"] = "mismatch"
    return dict(sorted(out.items()))


def compare_releases(old: dict[str, dict], new: dict[str, dict]) -> dict[str, str]:
    """Symbol -> what changed from `old` to `new`: unchanged | signature | code | missing | mismatch."""
    out = {}
    for path, a in old.items():
        b = new.get(path)
        if "n/a" in (a["status"], b and b["status"]):
            out[path] = "release-specific (ours: behind a vllm_release() check)"
        elif b is None or b["status"] == "missing":
            out[path] = "missing"
        elif b["status"] == "mismatch":
            out[path] = "mismatch"
        elif a["signature"] != b["signature"]:
            out[path] = "signature"
        elif a["fingerprint"] != b["fingerprint"]:
            out[path] = "code"
        else:
            out[path] = "unchanged"
    return out


def installed_vllm_root() -> Path:
    """The installed vllm's source root, found without importing it (importing vLLM takes seconds)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("vllm is not installed")
    return Path(next(iter(spec.submodule_search_locations))).parent


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-src", type=Path, help="folder holding vllm/ (default: the installed vllm)")
    args = ap.parse_args(argv)
    index = SourceIndex(args.vllm_src or installed_vllm_root())
    result = check(index, collect_uses(index))
    bad = {k: v for k, v in result.items() if v["status"] not in ("ok", "n/a")}
    print(json.dumps({"vllm": index.version(), "symbols": len(result), "not_ok": bad}, indent=1))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
