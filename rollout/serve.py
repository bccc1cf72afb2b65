"""vLLM's OpenAI-compatible server for our MiniMax-M3 checkpoints, with the m3rl plugin and LoRA adapters.

    python -m rollout.serve --model DIR [--adapter NAME=PATH ...] [--host 127.0.0.1 --port 8000] [vLLM args...]

This is `vllm serve` itself (vLLM's parser, arg validation and `ServeSubcommand.cmd`), with:
- LoRA on for every target module our plugin adapts (`rollout.plugin.lora.TARGET_MODULES`), each `--adapter`
  served under its name (`"model": NAME` in a request); the base model keeps its usual name (the model dir, or
  `--served-model-name`).
- CPU-friendly defaults, each dropped when the same vLLM option is given on the command line: eager mode,
  max-model-len 2048, block size 128 (MiniMax-M3's MSA block size), a fixed KV cache size on CPU (vLLM's CPU
  default reserves VLLM_CPU_KVCACHE_SPACE, 4 GiB), a few concurrent sequences, and on one CPU worker the model
  runs inside the engine-core process (executor "uni") instead of a third process: each vLLM process costs a
  ~20 s import on a small machine. `--distributed-executor-backend mp` restores vLLM's own choice.
- Checks of the model dir and adapter dirs before vLLM starts, so a typo is one line, not a traceback from an
  engine subprocess minutes later.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

PLUGIN_ENTRY_POINT = "m3rl"
CPU_KV_CACHE_BYTES = 256 << 20
# (option, value or None for a flag, only on CPU)
DEFAULTS: list[tuple[str, str | None, bool]] = [
    ("--enforce-eager", None, False),
    ("--max-model-len", "2048", False),
    ("--block-size", "128", False),
    ("--max-lora-rank", "32", False),
    ("--kv-cache-memory-bytes", str(CPU_KV_CACHE_BYTES), True),
    ("--max-num-seqs", "16", True),
]


class ServeError(ValueError):
    """Bad input found before vLLM starts."""


def _names(option: str) -> set[str]:
    # vLLM's parser accepts both spellings of each long option (`--max-model-len` / `--max_model_len`).
    return {option, "--" + option[2:].replace("-", "_")} if option.startswith("--") else {option}


def _given(option: str, argv: list[str]) -> bool:
    names = _names(option)
    return any(a.split("=", 1)[0] in names for a in argv)


def _option_value(option: str, argv: list[str]) -> str | None:
    names = _names(option)
    for i, a in enumerate(argv):
        if a in names and i + 1 < len(argv):
            return argv[i + 1]
        if "=" in a and a.split("=", 1)[0] in names:
            return a.split("=", 1)[1]
    return None


def check_model(model: str) -> Path:
    path = Path(model)
    if not path.is_dir():
        raise ServeError(f"--model {model}: no such directory (rollout.serve serves local checkpoints only)")
    if not (path / "config.json").is_file():
        raise ServeError(f"--model {model}: no config.json there, so it is not a checkpoint directory")
    return path.resolve()


def parse_adapter(spec: str) -> tuple[str, Path, dict]:
    """`NAME=PATH` -> (name, absolute path, adapter_config.json content)."""
    name, sep, path = spec.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ServeError(f"--adapter {spec!r}: expected NAME=PATH")
    adir = Path(path)
    if not adir.is_dir():
        raise ServeError(f"--adapter {name}={path}: no such directory")
    if not (adir / "adapter_config.json").is_file():
        raise ServeError(f"--adapter {name}={path}: no adapter_config.json there (expected peft's format: "
                         f"adapter_config.json + adapter_model.safetensors)")
    if not any((adir / f).is_file() for f in ("adapter_model.safetensors", "adapter_model.bin")):
        raise ServeError(f"--adapter {name}={path}: no adapter_model.safetensors there")
    try:
        config = json.loads((adir / "adapter_config.json").read_text())
    except json.JSONDecodeError as e:
        raise ServeError(f"--adapter {name}={path}: adapter_config.json is not valid JSON ({e})") from None
    return name.strip(), adir.resolve(), config


def check_plugin() -> None:
    """The engine core runs in a spawned process that only sees our patches through the entry point."""
    from importlib.metadata import entry_points

    if not any(ep.name == PLUGIN_ENTRY_POINT for ep in entry_points(group="vllm.general_plugins")):
        raise ServeError(f"the m3rl vLLM plugin is not installed (entry point vllm.general_plugins:"
                         f"{PLUGIN_ENTRY_POINT}); run `pip install -e .` in the repository")
    allowed = os.environ.get("VLLM_PLUGINS")
    if allowed is not None and PLUGIN_ENTRY_POINT not in allowed.split(","):
        raise ServeError(f"VLLM_PLUGINS={allowed!r} excludes {PLUGIN_ENTRY_POINT!r}: vLLM would start without "
                         f"the patches MiniMax-M3 needs here")


def _is_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def build_vllm_argv(argv: list[str] | None = None, *, on_cpu: bool | None = None) -> list[str]:
    """Our command line -> the `vllm serve` command line (without `serve`). Raises ServeError on bad input."""
    # allow_abbrev off: a vLLM option must never be taken for an abbreviation of one of ours.
    p = argparse.ArgumentParser(prog="python -m rollout.serve", add_help=True, allow_abbrev=False,
                                description="vLLM's OpenAI server with the m3rl plugin and LoRA adapters; "
                                            "other options go to vLLM (`vllm serve --help`).")
    p.add_argument("--model", required=True, help="checkpoint directory")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="a peft adapter directory to serve as model NAME (repeatable)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    ours, rest = p.parse_known_args(argv)

    model = check_model(ours.model)
    adapters = [parse_adapter(s) for s in ours.adapter]
    names = [a[0] for a in adapters]
    if len(set(names)) != len(names):
        raise ServeError(f"--adapter names must differ, got {names}")
    max_rank = int(_option_value("--max-lora-rank", rest) or 32)
    for name, path, config in adapters:
        rank = config.get("r")
        if isinstance(rank, int) and rank > max_rank:
            raise ServeError(f"--adapter {name}={path}: rank {rank} > --max-lora-rank {max_rank}")

    # Imported only now: importing vLLM takes ~15 s on a small CPU, too long to wait for a typo's error.
    from rollout.plugin.lora import TARGET_MODULES  # imports vLLM (above)

    on_cpu = _is_cpu() if on_cpu is None else on_cpu
    out = [str(model), "--host", ours.host, "--port", str(ours.port)]
    for option, value, cpu_only in DEFAULTS:
        if (cpu_only and not on_cpu) or _given(option, rest):
            continue
        if option == "--kv-cache-memory-bytes" and _given("--gpu-memory-utilization", rest):
            continue
        out += [option] if value is None else [option, value]
    if on_cpu and not any(_given(o, rest) for o in ("--distributed-executor-backend", "--tensor-parallel-size",
                                                    "-tp", "--pipeline-parallel-size", "-pp")):
        out += ["--distributed-executor-backend", "uni"]
    if not _given("--max-loras", rest) and len(adapters) > 1:
        out += ["--max-loras", str(len(adapters))]  # so a batch mixing every adapter is not serialized
    out += ["--enable-lora"]
    if not _given("--lora-target-modules", rest):
        out += ["--lora-target-modules", *TARGET_MODULES]
    if adapters:
        out += ["--lora-modules", *(f"{name}={path}" for name, path, _ in adapters)]
    return out + rest


def _serve_cli_helpers():
    """(make_arg_parser, cli_env_setup): vLLM 0.33 moved both, unchanged, to `vllm.entrypoints.common`
    (results/gpu_profile_check.json)."""
    from rollout.plugin.registry import vllm_release  # imports vLLM: only once serving starts

    if vllm_release() == "0.32.0":
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    else:
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.entrypoints.common.startup import cli_env_setup
    return make_arg_parser, cli_env_setup


def main(argv: list[str] | None = None) -> None:
    try:
        check_plugin()
        vllm_argv = build_vllm_argv(sys.argv[1:] if argv is None else argv)
    except ServeError as e:
        print(f"rollout.serve: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None

    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    import rollout.plugin  # imports vLLM: only after the arguments are checked

    rollout.plugin.register()  # this (front-end) process; the engine core gets it from the entry point
    if _option_value("--distributed-executor-backend", vllm_argv) == "uni":
        # vLLM's CPU platform swaps "uni" for "mp" unless this is 0; the API server's engine core is a separate
        # process either way (AsyncLLM always runs it so), and it inherits the setting.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    make_arg_parser, cli_env_setup = _serve_cli_helpers()
    cli_env_setup()
    parser = make_arg_parser(FlexibleArgumentParser(prog="python -m rollout.serve"))
    args = parser.parse_args(vllm_argv)
    args.subparser = "serve"  # what `vllm serve` sets; vLLM's checks key on it
    configure_logging_from_args(args)
    cmd = ServeSubcommand()
    cmd.validate(args)
    print("rollout.serve: vllm serve " + " ".join(vllm_argv), file=sys.stderr, flush=True)
    cmd.cmd(args)


if __name__ == "__main__":
    main()
