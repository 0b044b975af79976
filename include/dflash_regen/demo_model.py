"""A small stand-in for the Qwen3.6-27B model directory, for the demo and the tests.

It has the real model's `config.json` shape (the emulator and the launcher read its architecture and
context length), a few megabytes of fake weight shards so staging has something to copy and verify, and a
`SHA256SUMS` manifest as a careful download would leave.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "text_config": {
        "model_type": "qwen3_5_text",
        "hidden_size": 5120,
        "num_hidden_layers": 64,
        "full_attention_interval": 4,
        "num_attention_heads": 24,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 262144,
        "vocab_size": 248320,
        "mtp_num_hidden_layers": 1,
    },
    "eos_token_id": 248046,
    "torch_dtype": "bfloat16",
}


def write_demo_model(path: Path, *, shards: int = 2, shard_bytes: int = 4 * 1024 * 1024) -> Path:
    """Create (idempotently) a demo model dir at `path` and return it."""
    path.mkdir(parents=True, exist_ok=True)
    files = {"config.json": json.dumps(CONFIG, indent=2).encode()}
    for i in range(shards):
        # Deterministic bytes so re-creating the dir gives the same checksums.
        seed = hashlib.sha256(f"shard-{i}".encode()).digest()
        files[f"model-{i + 1:05d}-of-{shards:05d}.safetensors"] = (seed * (shard_bytes // len(seed) + 1))[:shard_bytes]
    for name, data in files.items():
        target = path / name
        if not target.is_file() or target.read_bytes() != data:
            tmp = target.with_name(name + ".partial")
            tmp.write_bytes(data)
            os.replace(tmp, target)
    sums = "".join(f"{hashlib.sha256(data).hexdigest()}  {name}\n" for name, data in sorted(files.items()))
    (path / "SHA256SUMS").write_text(sums)
    return path
