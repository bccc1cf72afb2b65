"""Reads an offline W&B run's `.wandb` file back as wandb's own protobuf records (`wandb.proto.wandb_internal_pb2
.Record`). wandb 0.31 writes the file from its Go core and ships no Python reader (the old
`wandb.sdk.internal.datastore` is gone), so the framing is read here: LevelDB's log format (32 KiB blocks, 7-byte
record headers: masked-free CRC32, length, type FULL/FIRST/MIDDLE/LAST) after wandb's 7-byte ":W&B" file header."""

import json
import struct
import zlib
from pathlib import Path

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32768
HEADER = struct.Struct("<4sHB")  # ident ":W&B", magic 0xBEE1, version 0
RECORD = struct.Struct("<IHB")  # crc32, length, type
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def read_records(path) -> list:
    data = Path(path).read_bytes()
    ident, magic, version = HEADER.unpack_from(data, 0)
    assert ident == b":W&B" and magic == 0xBEE1 and version == 0, (ident, magic, version)
    out, pos, pending = [], HEADER.size, b""
    while pos + RECORD.size <= len(data):
        left = BLOCK - pos % BLOCK
        if left < RECORD.size:  # the block's tail is padding
            pos += left
            continue
        crc, length, kind = RECORD.unpack_from(data, pos)
        if kind == 0 and length == 0:  # zero padding at the end of the file
            break
        payload = data[pos + RECORD.size:pos + RECORD.size + length]
        assert zlib.crc32(bytes([kind]) + payload) & 0xFFFFFFFF == crc, f"bad CRC at offset {pos}"
        pos += RECORD.size + length
        pending = payload if kind in (FULL, FIRST) else pending + payload
        if kind in (FULL, LAST):
            rec = pb.Record()
            rec.ParseFromString(pending)
            out.append(rec)
    return out


def run_file(run_dir) -> Path:
    files = sorted(Path(run_dir).glob("wandb/*run-*/run-*.wandb"))
    assert len(files) == 1, files
    return files[0]


def summarize(path) -> dict:
    """{config: {key: value}, history: [{key: value}], artifacts: [(name, type, [paths])], files: [paths]}."""
    records = read_records(path)
    config, history, artifacts, files = {}, [], [], []
    for rec in records:
        kind = rec.WhichOneof("record_type")
        if kind in ("config", "run"):  # the run record carries the config given to wandb.init
            update = rec.config.update if kind == "config" else rec.run.config.update
            config.update({item.key: json.loads(item.value_json) for item in update})
        elif kind == "history":
            history.append({(item.key or "/".join(item.nested_key)): json.loads(item.value_json)
                            for item in rec.history.item})
        elif kind == "artifact":
            artifacts.append((rec.artifact.name, rec.artifact.type, [e.path for e in rec.artifact.manifest.contents]))
        elif kind == "files":
            files += [f.path for f in rec.files.files]
    return {"config": config, "history": history, "artifacts": artifacts, "files": files}
