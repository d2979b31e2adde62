"""Get FineWeb as GPT-2 token shards in the llm.c / NoCap-Test .bin format.

    python data/fineweb.py -n 25                 # NoCap's pre-tokenized shards: val + train 1..25 (2.5B tokens)
    python data/fineweb.py --source raw          # tokenize FineWeb sample-10BT yourself (streamed)
    python data/fineweb.py --source raw --input 'my/*.parquet' --output_dir data/mine --prefix mine

Both sources write the same format: a 256-int32 header (magic 20240520, version 1, token count) and
uint16 token ids, every document preceded by <|endoftext|>; shard 000000 is the validation shard.
Files are written to a temporary name and renamed, so an interrupted run never leaves a torn shard.
"""

import glob
import itertools
import multiprocessing
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.shards import (HEADER_BYTES, ArgumentParser, InputError, need_package, read_shard_header,  # noqa: E402
                         write_shard)

CACHED_REPO = "kjj0/fineweb10B-gpt2"  # the shards NoCap-Test and modded-nanogpt train on
CACHED_TRAIN_SHARDS = 103  # available in that repository (100M tokens each)
NOCAP_MAX_TRAIN_SHARDS = 50  # NoCap's 5B-token budget
RAW_DATASET = ("HuggingFaceFW/fineweb", "sample-10BT")
EOT = 50256  # <|endoftext|>, the document delimiter
CACHED_SHARD_BYTES = HEADER_BYTES + 2 * 100_000_000  # 100M uint16 tokens after the header


# -----------------------------------------------------------------------------
# --source cached: download NoCap's pre-tokenized shards

def cached_shard_names(n_train: int) -> list[str]:
    return ["fineweb_val_000000.bin"] + [f"fineweb_train_{i:06d}.bin" for i in range(1, n_train + 1)]


def hf_fetch(name: str, dest_dir: str) -> str:
    """Download one file of the cached dataset into dest_dir; return its path. Any failure of the
    transport (no network, hub errors, a full disk) is reported as one line naming the file."""
    from huggingface_hub import hf_hub_download
    try:
        return hf_hub_download(repo_id=CACHED_REPO, filename=name, repo_type="dataset", local_dir=dest_dir)
    except Exception as e:  # noqa: BLE001 — reported, not hidden: the message carries the cause
        cause = (str(e).strip().splitlines() or [""])[0]
        raise InputError(f"{name}: download from {CACHED_REPO} failed ({type(e).__name__}: {cause}); check the "
                         "network (or HF_ENDPOINT) and run again — complete shards are kept") from None


def is_complete_shard(path: str) -> bool:
    try:
        read_shard_header(path)
    except InputError:
        return False
    return True


def download_cached(output_dir: str, n_train: int, fetch=hf_fetch) -> list[str]:
    """Make sure val + train shards 1..n_train are in output_dir, complete and valid. Files already
    complete are skipped; the free disk is checked before anything is fetched; each new file is fetched into
    output_dir/.download, verified, then renamed into place. A transfer that breaks leaves its partial file
    there, and huggingface_hub resumes it on the next run. `fetch(name, dest_dir) -> path` is the transport
    (huggingface_hub unless a test swaps it)."""
    if not 1 <= n_train <= CACHED_TRAIN_SHARDS:
        raise InputError(f"-n {n_train}: the cached dataset has train shards 1..{CACHED_TRAIN_SHARDS}")
    if n_train > NOCAP_MAX_TRAIN_SHARDS:
        print(f"notice: NoCap-Test allows train shards 1..{NOCAP_MAX_TRAIN_SHARDS}; -n {n_train} goes beyond it")
    from tqdm import tqdm
    os.makedirs(output_dir, exist_ok=True)
    paths = [os.path.join(output_dir, name) for name in cached_shard_names(n_train)]
    missing = [path for path in paths if not (os.path.exists(path) and is_complete_shard(path))]
    need, free = len(missing) * CACHED_SHARD_BYTES, shutil.disk_usage(output_dir).free
    if need > free:
        raise InputError(f"{output_dir}: the {len(missing)} shards to download need {need / 1e9:.1f} GB and "
                         f"{free / 1e9:.1f} GB is free; free some space or pass --output_dir on a larger disk")
    scratch = os.path.join(output_dir, ".download")
    os.makedirs(scratch, exist_ok=True)
    for dest in tqdm(missing, desc="shards", unit="file"):
        name = os.path.basename(dest)
        fetched = fetch(name, scratch)
        try:
            read_shard_header(fetched)
        except InputError as e:
            os.remove(fetched)
            raise InputError(f"downloaded {name} is not a valid shard ({e}); nothing was replaced — "
                             "run the command again") from None
        os.replace(fetched, dest)
    shutil.rmtree(scratch, ignore_errors=True)
    return paths


# -----------------------------------------------------------------------------
# --source raw: tokenize documents with tiktoken's GPT-2 encoding

def iter_texts(inputs: str | None):
    """Document texts, streamed: local parquet/jsonl files if `inputs` (a glob) is given, else FineWeb
    sample-10BT from the Hugging Face hub. Documents with no text are skipped. Bad inputs are reported
    here, before any tokenizer process starts."""
    need_package("datasets", "--source raw (it reads documents with the datasets package)")
    from datasets import load_dataset
    if inputs:
        files = sorted(glob.glob(inputs))
        if not files:
            raise InputError(f"--input: no files match {inputs!r}")
        kinds = {".parquet": "parquet", ".jsonl": "json", ".json": "json"}
        exts = {os.path.splitext(f)[1] for f in files}
        if len(exts) != 1 or next(iter(exts)) not in kinds:
            raise InputError(f"--input: expected only .parquet or only .jsonl files, got {sorted(exts)}")
        dataset = load_dataset(kinds[exts.pop()], data_files=files, split="train", streaming=True)
    else:
        dataset = load_dataset(RAW_DATASET[0], name=RAW_DATASET[1], split="train", streaming=True)
    return (row["text"] for row in dataset if row.get("text"))


_encoder = None


def tokenize(text: str) -> np.ndarray:
    """<|endoftext|> followed by the document's GPT-2 tokens (special-token text is encoded as text)."""
    global _encoder
    if _encoder is None:  # once per worker process
        import tiktoken
        _encoder = tiktoken.get_encoding("gpt2")
    return np.array([EOT] + _encoder.encode_ordinary(text), dtype=np.uint16)


class ShardWriter:
    """Packs token arrays into fixed-size shards: 000000 (val) first, then train 000001, 000002, ...
    A document that straddles a boundary is split, as llm.c and NoCap's shards are."""

    def __init__(self, output_dir: str, prefix: str, shard_size: int):
        self.output_dir, self.prefix, self.shard_size = output_dir, prefix, shard_size
        self.buffer = np.empty(shard_size, dtype=np.uint16)
        self.filled, self.index, self.written = 0, 0, []

    def add(self, tokens: np.ndarray):
        while tokens.size:
            take = min(tokens.size, self.shard_size - self.filled)
            self.buffer[self.filled: self.filled + take] = tokens[:take]
            self.filled += take
            tokens = tokens[take:]
            if self.filled == self.shard_size:
                self.flush()

    def flush(self):
        if self.filled == 0:
            return
        split = "val" if self.index == 0 else "train"
        path = os.path.join(self.output_dir, f"{self.prefix}_{split}_{self.index:06d}.bin")
        write_shard(path, self.buffer[: self.filled])
        self.written.append(path)
        self.index, self.filled = self.index + 1, 0


def tokenize_to_shards(texts, output_dir: str, prefix: str, shard_size: int, max_tokens: int | None = None,
                       workers: int | None = None) -> list[str]:
    """Tokenize `texts` in a process pool and write shards; stop after max_tokens if given."""
    existing = sorted(glob.glob(os.path.join(output_dir, f"{prefix}_*.bin")))
    if existing:
        raise InputError(f"{existing[0]} already exists; choose another --output_dir or --prefix, or delete "
                         "the old shards")
    if shard_size < 1:
        raise InputError(f"--shard_size {shard_size} must be >= 1")
    from tqdm import tqdm
    os.makedirs(output_dir, exist_ok=True)
    writer = ShardWriter(output_dir, prefix, shard_size)
    total, texts = 0, iter(texts)
    with multiprocessing.Pool(workers or max(1, os.cpu_count() - 1)) as pool, \
            tqdm(total=max_tokens, unit="tok", unit_scale=True, desc="tokenizing") as bar:
        # Feed the pool a bounded batch at a time: Pool.imap would drain a streamed dataset into memory.
        while batch := list(itertools.islice(texts, 1024)):
            for tokens in pool.imap(tokenize, batch, chunksize=16):
                if max_tokens is not None:
                    tokens = tokens[: max_tokens - total]
                writer.add(tokens)
                total += tokens.size
                bar.update(tokens.size)
            if max_tokens is not None and total >= max_tokens:
                break
    writer.flush()
    return writer.written


# -----------------------------------------------------------------------------

def main(argv=None) -> int:
    p = ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", choices=("cached", "raw"), default="cached",
                   help="cached: download NoCap's pre-tokenized shards; raw: tokenize documents yourself")
    p.add_argument("-n", "--num_train_shards", type=int, default=25,
                   help="cached: train shards 1..N of 100M tokens (the d12 baseline reads 2.5B tokens = 25)")
    p.add_argument("--output_dir", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "fineweb10B"))
    p.add_argument("--input", default=None,
                   help="raw: glob of local .parquet or .jsonl files with a 'text' column (default: stream "
                        f"{RAW_DATASET[0]} {RAW_DATASET[1]} from the hub)")
    p.add_argument("--prefix", default="fineweb", help="raw: shard names are <prefix>_{val,train}_NNNNNN.bin")
    p.add_argument("--shard_size", type=int, default=100_000_000, help="raw: tokens per shard")
    p.add_argument("--max_tokens", type=int, default=None, help="raw: stop after this many tokens")
    p.add_argument("--workers", type=int, default=None, help="raw: tokenizer processes (default: cores - 1)")
    args = p.parse_args(argv)

    try:
        if args.source == "cached":
            paths = download_cached(args.output_dir, args.num_train_shards)
        else:
            paths = tokenize_to_shards(iter_texts(args.input), args.output_dir, args.prefix, args.shard_size,
                                       args.max_tokens, args.workers)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{len(paths)} shards in {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
