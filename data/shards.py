"""The llm.c / NoCap-Test token-shard format: read, written and checked, without torch.

A shard is a header of 256 int32 (magic 20240520, version 1, token count, then zeros) followed by that many
uint16 GPT-2 token ids. The trainer reads shards with these functions and data/fineweb.py writes them, so a
download needs numpy, not the trainer. A bad shard raises common.InputError naming the file and the fix.
"""

import glob
import os

import numpy as np

from common import InputError

SHARD_MAGIC = 20240520
SHARD_VERSION = 1
HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
COMPRESSED = {"xz": b"\xfd7zXZ\x00", "gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd"}  # their files' first bytes
COMPRESSED_FIX = {"xz": "xz -dk", "gzip": "gunzip -k", "zstd": "zstd -d"}


def check_output_file(path: str, flag: str):
    """A file a tool is asked to write (a plot, a table): its folder exists and can be written, or one error line
    before any work is done."""
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InputError(f"{flag} {path}: no such folder {folder}; create it or pass another path")
    if not os.access(folder, os.W_OK):
        raise InputError(f"{flag} {path}: {folder} cannot be written; pass another path")


def read_shard_header(path: str) -> int:
    """Validate a shard's header against its size; return its token count."""
    try:
        size = os.path.getsize(path)
        header = np.fromfile(path, dtype=np.int32, count=HEADER_INTS)
    except OSError as e:
        raise InputError(f"{path}: cannot be read ({e.strerror}); check the file and its permissions") from None
    compression = next((name for name, magic in COMPRESSED.items() if header.tobytes().startswith(magic)), None)
    if compression:
        raise InputError(f"{path}: a {compression}-compressed file, not a token shard; decompress it first "
                         f"({COMPRESSED_FIX[compression]} {path}; a folder of .bin.xz: python scripts/proxy.py stage)")
    if size < HEADER_BYTES:
        raise InputError(f"{path}: {size} bytes is shorter than the {HEADER_BYTES}-byte header — "
                         "not a token shard; re-create it with python data/fineweb.py")
    if header[0] != SHARD_MAGIC:
        raise InputError(f"{path}: header magic {header[0]} != {SHARD_MAGIC} — not a GPT-2 token shard; "
                         "re-create it with python data/fineweb.py")
    if header[1] != SHARD_VERSION:
        raise InputError(f"{path}: shard version {header[1]} != {SHARD_VERSION}; re-create it with "
                         "python data/fineweb.py")
    n_tokens = int(header[2])
    if size != HEADER_BYTES + 2 * n_tokens:
        raise InputError(f"{path}: header says {n_tokens:,} tokens but the file holds "
                         f"{(size - HEADER_BYTES) / 2:,.1f} — truncated or corrupt; download it again")
    return n_tokens


def check_token_range(path: str, tokens: np.ndarray, vocab_size: int):
    """Every token id below vocab_size, or one error line naming the first one that is not."""
    if tokens.size and int(tokens.max()) >= vocab_size:
        bad = int(np.argmax(tokens >= vocab_size))
        raise InputError(f"{path}: token id {int(tokens[bad])} at position {bad:,} is >= vocab_size "
                         f"{vocab_size} — shard made with another tokenizer, or the wrong --vocab_size")


def load_shard(path: str, vocab_size: int, count: int = -1) -> np.ndarray:
    """The shard's uint16 tokens (the first `count` only, if given), checked against the vocabulary."""
    n_tokens = read_shard_header(path)
    tokens = np.fromfile(path, dtype=np.uint16, offset=HEADER_BYTES, count=n_tokens if count < 0 else count)
    check_token_range(path, tokens, vocab_size)
    return tokens


def write_shard(path: str, tokens: np.ndarray) -> None:
    """Write tokens as a shard atomically (temp file in the same directory, then rename)."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**16):
        raise ValueError(f"{path}: token ids must fit in uint16")
    header = np.zeros(HEADER_INTS, dtype=np.int32)
    header[:3] = (SHARD_MAGIC, SHARD_VERSION, tokens.size)
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(header.tobytes())
        f.write(tokens.astype(np.uint16).tobytes())
    os.replace(tmp, path)


def match_shards(pattern: str, flag: str) -> list[str]:
    """The shards a glob names, in sorted order (the order they are read in)."""
    files = sorted(glob.glob(pattern))
    if not files:
        raise InputError(f"{flag}: no files match {pattern!r}; download FineWeb with "
                         "`python data/fineweb.py` or point the flag at existing .bin shards")
    directories = [path for path in files if os.path.isdir(path)]
    if directories:
        raise InputError(f"{flag}: {directories[0]} is a directory, not a shard; narrow {pattern!r} to the .bin "
                         "files")
    return files
