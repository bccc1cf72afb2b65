"""Compile the block-outer MSA kernels (rl.model.msa_block_outer, _gluon) for Hopper without a GPU; print registers,
spills, shared memory and whether ptxas serialized the wgmma pipeline, per kernel, as JSON (what METHOD.md calls the
compiler's resource report; no device time).

    PYTHONPATH=.venv/triton-interpret python scripts/msa_kernel_resources.py                # M3 shapes, the defaults
    PYTHONPATH=.venv/triton-interpret python scripts/msa_kernel_resources.py --bwd-warps 4 --bwd-keys 64

Needs a full Triton (the interpreter install of scripts/install/setup_env.sh is one: it carries ptxas and cuobjdump);
no CUDA driver. "stack" is the per-thread local memory the compiler spilled to (0 = no spills).
"""

import argparse
import dataclasses
import json
import os
import re
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))


# Integer arguments that are multiples of 16 at M3 sizes (T, blocks, entries at 4K-64K tokens): a launch specialises
# them, and every pointer argument (torch allocations are 16-byte aligned), as 16-divisible. Without these hints the
# compiler cannot prove 16-byte vectors and compiles a different kernel (no cp.async pipelining, spills).
DIVISIBLE_INTS = ("T", "NKB", "NE")


def tma_descriptor_type(rows: int, cols: int) -> str:
    """The signature type of a TMA descriptor argument: bf16 boxes of rows x cols in the default NVMMA shared layout
    (what TensorDescriptor.from_tensor(t, [rows, cols], that layout) passes at a launch)."""
    from triton.experimental.gluon import language as gl

    layout = gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)
    return f"tensordesc<bf16[{rows}, {cols}],{layout!r}>"


def compile_report(fn, types, constexprs, num_warps, num_stages, arch=90, divisible=DIVISIBLE_INTS, maxnreg=None,
                   loads=False):
    """Compile `fn` for sm_<arch> as a launch would (alignment hints: pointers and the int arguments named in
    `divisible`; `maxnreg` as the launch passes it); registers / stack / static shared from cuobjdump, dynamic shared
    from Triton; with `loads`, the layout of every global load (load_layouts)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    gluon = hasattr(fn, "is_gluon") and fn.is_gluon()
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as ASTSource  # noqa: N814
        constexprs = dict(constexprs, num_warps=num_warps)
    names = fn.arg_names
    sig = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names)
             if n not in constexprs and (sig[n].startswith("*") or n in divisible)}
    src = ASTSource(fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()}, attrs=attrs)
    options = dict(num_warps=num_warps, num_stages=num_stages, **({"maxnreg": maxnreg} if maxnreg else {}))
    k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(k.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    usage = next(line for line in out.splitlines() if "REG:" in line)
    # ptxas's own report: whether it had to serialize the wgmma pipeline (C7514, a silent slowdown otherwise)
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(k.asm["ptx"])
        f.flush()
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
        info = subprocess.run([ptxas, f"-arch=sm_{arch}a", "-v", f.name, "-o", os.devnull], capture_output=True,
                              text=True, check=True).stderr
    fields = dict(item.split(":") for item in usage.split() if ":" in item and item.split(":")[1].isdigit())
    return {"kernel": fn.__name__, "warps": num_warps, "stages": None if gluon else num_stages,
            "registers": int(fields["REG"]),
            "stack_bytes": int(fields["STACK"]), "shared_bytes": k.metadata.shared,
            "wgmma_serialized": "C7514" in info, "mma_loop_spills": mma_loop_spills(sass),
            **({"loads": load_layouts(k.asm["ttgir"])} if loads else {})}


def load_layouts(ttgir: str) -> list:
    """Each `tt.load` of the TTGIR: its tensor shape, element type and blocked layout (sizePerThread, threadsPerWarp,
    order): which elements a thread and the consecutive lanes of a warp read, i.e. whether the loads coalesce."""
    layouts = {m.group(1): {key: [int(v) for v in m.group(2 + i).split(",")]
                            for i, key in enumerate(("sizePerThread", "threadsPerWarp", "order"))}
               for m in re.finditer(r"^(#blocked\d*) = #ttg\.blocked<\{sizePerThread = \[([\d, ]+)\], "
                                    r"threadsPerWarp = \[([\d, ]+)\], warpsPerCTA = \[[\d, ]+\], "
                                    r"order = \[([\d, ]+)\]", ttgir, re.M)}
    out = []
    for m in re.finditer(r"= tt\.load [^:]*: tensor<([\dx]+)x!tt\.ptr<(\w+)>, (#\w+)>", ttgir):
        out.append(dict(shape=[int(d) for d in m.group(1).split("x")], dtype=m.group(2), **layouts.get(m.group(3), {})))
    return out


def mma_loop_spills(sass: str):
    """Local-memory stores + loads (spill traffic) per iteration of the innermost SASS loop that issues wgmma
    (HGMMA), or None without one. A warp-specialized kernel shares one register file among its partitions: a
    partition given few registers may spill outside that loop (the stack size counts it) while the MMA loop runs clean.
    """
    ins = []
    for line in sass.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)(.*)", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(2), m.group(3)))
    loops = []
    for addr, op, rest in ins:
        target = re.search(r"0x([0-9a-f]+)", rest) if op.startswith("BRA") else None
        if target and int(target.group(1), 16) < addr:
            body = [o for a, o, _ in ins if int(target.group(1), 16) <= a <= addr]
            if any(o.startswith("HGMMA") for o in body):
                loops.append(body)
    if not loops:
        return None
    return sum(o.startswith(("STL", "LDL")) for o in min(loops, key=len))


def main():
    from rl.model import msa_block_outer as mbo
    from rl.model import msa_block_outer_gluon as mbog
    from rl.model import msa_block_outer_gluon_ws as mbows
    from rl.model import msa_block_plan as mbp

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(mbo.Config):
        if f.type in ("int", int):
            p.add_argument("--" + f.name.replace("_", "-"), type=int, default=f.default)
    p.add_argument("--hq", type=int, default=64)
    p.add_argument("--hkv", type=int, default=4)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--topk", type=int, default=16)
    a = p.parse_args()
    g = a.hq // a.hkv
    shapes = dict(HQ=a.hq, HKV=a.hkv, G=g, TOPK=a.topk, D=a.dim)
    i32 = {n: "*i32" for n in ("ent_ptr", "order_ptr", "key_ptr", "lo_ptr", "hi_ptr", "kstart_ptr", "seq_ptr",
                               "gid_ptr", "key_item0_ptr", "item_key_ptr", "okey_ptr", "pos_ptr", "dense_row_ptr",
                               "kend_ptr")}
    bf16 = {n: "*bf16" for n in ("q_ptr", "k_ptr", "v_ptr", "do_ptr", "opart_ptr", "dq_ptr", "dqp_ptr", "o_ptr",
                                 "dense_ptr", "dk_ptr", "dv_ptr")}
    f32 = {n: "*fp32" for n in ("lpart_ptr", "lse_ptr", "delta_ptr", "dks_ptr", "dvs_ptr")}
    types = {**i32, **bf16, **f32, "ids_ptr": "*i64", "idx_ptr": "*i64", "qk_scale": "fp32",
             "scale": "fp32"}
    (ftm, fbm), (btm, bbm) = mbo.tile_shape(a.fwd_rows, g), mbo.tile_shape(a.bwd_rows, g)

    def desc(rows):  # TMA boxes of `rows` x head-dim
        return tma_descriptor_type(rows, a.dim)

    ws_fwd_desc = dict(q_desc=desc(g), k_desc=desc(128), v_desc=desc(128), o_desc=desc(g), o_tile_desc=desc(64))
    rows = [
        compile_report(mbp._plan_keys, types, dict(HKV=a.hkv, TOPK=a.topk, BE=1024), 4, 3),
        *(compile_report(mbp._plan_index, types, dict(HKVTOPK=a.hkv * a.topk, SIZE_ORDER=False, NP=np_, BE=1024,
                                                      CH=1024), warps, 3) | {"NP": np_}
          for np_, warps in ((1024, 4), (mbp.KERNEL_SORT_MAX, 4))),  # the launch-order sort: 4K tokens' items, most
        compile_report(mbo._fwd, types, dict(shapes, TM=ftm, BM=fbm, PREC="tf32"), a.fwd_warps,
                       a.fwd_stages),
        compile_report(mbog._fwd_gluon, types, dict(shapes, TM=ftm, BM=fbm), fbm // 16, 1),
        compile_report(mbo._bwd, types, dict(shapes, TM=btm, BM=bbm, BN=a.bwd_keys, PREC="tf32",
                                             DQ_ATOMIC=False), a.bwd_warps, a.bwd_stages),
        compile_report(mbows._fwd_gluon_ws, dict(types, **ws_fwd_desc),
                       dict({k: v for k, v in shapes.items() if k != "D"}, TM=64 // g, S=mbows.WS_FWD["S"]),
                       mbows.WS_FWD["num_warps"], 1,
                       maxnreg=mbows.WS_FWD["maxnreg"]),
        compile_report(mbog._bwd_gluon, types, dict(shapes, TM=btm, BM=bbm), 8, 1),
        *(compile_report(mbows._bwd_gluon_ws, dict(types, dq_desc=desc(g), dq_tile_desc=desc(bbm)),
                         dict(shapes, TM=btm, BM=bbm, S=a.bwd_stages, DQ_TMA=dq_tma, SPLIT=split,
                              **{k: v for k, v in mbows.WS_BWD.items() if k not in ("num_warps", "maxnreg")}),
                         mbows.WS_BWD["num_warps"], 1, maxnreg=mbows.WS_BWD["maxnreg"])
          | {"DQ_TMA": dq_tma, "SPLIT": split}  # the dQ stores x Config.bwd_loops (split / masked)
          for dq_tma in (True, False) for split in (True, False)),
        compile_report(mbo._merge, types, dict(shapes, R=a.row_tile, HAS_DENSE=False,
                                               TP=1 << (a.topk - 1).bit_length()), 4, 3),
        compile_report(mbo._reduce_grads, types, dict(shapes, NH=128 // a.bwd_keys, R=a.row_tile,
                                                      DC=a.dkdv_cols), 4, 3),
    ]
    print(json.dumps({"command": " ".join(["python"] + sys.argv), "arch": "sm_90", "kernels": rows}, indent=1))


if __name__ == "__main__":
    main()
