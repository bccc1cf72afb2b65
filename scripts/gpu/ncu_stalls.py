"""Where a kernel's warps wait, from the per-SASS-instruction page Nsight Compute writes (scripts/gpu/run.sh ncu_msa /
ncu_expert: `ncu -i REPORT --page source --csv --print-source sass`): per kernel, the warp-stall samples by reason,
the instructions holding the most samples, the shared-memory wavefronts against the ideal (bank conflicts), and,
with --split ADDR, the samples below and from that address, or with --ranges, those of each range with its executed
instructions by opcode (warp partitions of a warp-specialized kernel sit in separate address ranges).

    python scripts/gpu/ncu_stalls.py results/gpu/run45/ncu_text.tgz                # every kernel in the page
    python scripts/gpu/ncu_stalls.py PAGE.txt --kernel 2 --top 40 --split 0x1200   # offsets from the kernel's start
    python scripts/gpu/ncu_stalls.py PAGE.txt --kernel 0 --ranges 0x600:0x2400,0x3f80:0x4370  # partitions' loops

Runs anywhere (no GPU, no Nsight Compute): it reads the CSV text only.
"""

import argparse
import collections
import csv
import io
import tarfile

ALL = "Warp Stall Sampling (All Samples)"


def read_page(path: str) -> str:
    """The page's text, from the file or from the *_sass.txt member of a .tgz."""
    if path.endswith((".tgz", ".tar.gz")):
        with tarfile.open(path) as tar:
            member = next(m for m in tar.getmembers() if m.name.endswith("_sass.txt"))
            return tar.extractfile(member).read().decode()
    with open(path) as f:
        return f.read()


def kernels(text: str) -> list[tuple[str, list[dict]]]:
    """[(kernel name, rows as dicts)] in the page's order; each block starts with a "Kernel Name" line."""
    out, block = [], None
    for line in text.splitlines():
        if line.startswith('"Kernel Name"'):
            block = [line]
            out.append(block)
        elif block is not None:
            block.append(line)
    parsed = []
    for block in out:
        name = next(csv.reader([block[0]]))[1]
        rows = list(csv.DictReader(io.StringIO("\n".join(block[1:]))))
        parsed.append((name, [r for r in rows if r.get(ALL, "").isdigit()]))
    return parsed


def summarize(name: str, rows: list[dict], top: int, split: int | None, ranges=()) -> str:
    reasons = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c] if rows else []
    total = sum(int(r[ALL]) for r in rows) or 1
    base = min(int(r["Address"], 16) for r in rows) if rows else 0
    by_reason = collections.Counter({c: sum(int(r[c] or 0) for r in rows) for c in reasons})
    lines = [f"{name}: {total} samples"]
    wf = {c: sum(int(r.get(c) or 0) for r in rows if (r.get(c) or "0").isdigit())
          for c in ("L1 Wavefronts Shared", "L1 Wavefronts Shared Ideal", "L1 Wavefronts Shared Excessive")}
    if wf["L1 Wavefronts Shared"]:  # shared-memory wavefronts (loads, stores, wgmma operands): bank conflicts
        lines.append("  shared wavefronts {} (ideal {}, excessive {})".format(*wf.values()))
    lines += [f"  {c[6:]:20s} {v / total:6.1%}" for c, v in by_reason.most_common(10)]
    def part_line(label, lo, hi, opcodes=False):  # the samples at offsets [lo, hi), their top reasons
        part = [r for r in rows if lo <= int(r["Address"], 16) - base < hi]
        n = sum(int(r[ALL]) for r in part) or 1
        top_reasons = collections.Counter({c: sum(int(r[c] or 0) for r in part) for c in reasons}).most_common(5)
        line = f"  {label}: {n / total:.1%} of samples; " + ", ".join(f"{c[6:]} {v / n:.1%}" for c, v in top_reasons)
        if opcodes:  # executed warp instructions by opcode, e.g. for one warp partition's loop
            ops = collections.Counter()
            for r in part:
                words = r["Source"].split()
                if words:
                    op = words[1] if words[0].startswith("@") and len(words) > 1 else words[0]
                    ops[op.split(".")[0]] += int(r.get("Instructions Executed") or 0)
            line += "; warp instructions executed: " + ", ".join(f"{o} {v}" for o, v in ops.most_common(8))
        return line

    if split is not None:
        lines += [part_line(f"below +{split:#x}", 0, split), part_line(f"from +{split:#x}", split, 1 << 62)]
    lines += [part_line(f"+{lo:#x}..+{hi:#x}", lo, hi, opcodes=True) for lo, hi in ranges]
    lines.append(f"  top {top} instructions (offset from the kernel's first, share of samples, top reasons):")
    for r in sorted(rows, key=lambda r: -int(r[ALL]))[:top]:
        st = sorted(((int(r[c] or 0), c[6:]) for c in reasons), reverse=True)[:2]
        lines.append(f"  +{int(r['Address'], 16) - base:05x} {int(r[ALL]) / total:5.1%}  {r['Source'][:60]:60s} "
                     + ", ".join(f"{c} {v}" for v, c in st if v))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("page", help="the source page as text, or a .tgz holding *_sass.txt")
    ap.add_argument("--kernel", type=int, default=None, help="only the N-th kernel of the page (0-based)")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--split", type=lambda s: int(s, 0), default=None, help="offset splitting the samples in two")
    ap.add_argument("--ranges", default="", help="offset ranges LO:HI,... (hex or decimal) summarized one by one")
    args = ap.parse_args()
    found = kernels(read_page(args.page))
    for i, (name, rows) in enumerate(found):
        if args.kernel is None or i == args.kernel:
            ranges = [tuple(int(v, 0) for v in r.split(":")) for r in args.ranges.split(",") if r]
            print(f"[{i}] " + summarize(name, rows, args.top, args.split, ranges))


if __name__ == "__main__":
    main()
