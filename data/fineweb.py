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
import json
import multiprocessing
import os
import shutil
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from data.shards import HEADER_BYTES, read_shard_header, write_shard  # noqa: E402
from common import ArgumentParser, InputError, need_package  # noqa: E402

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

def gpt2_encoding():
    """tiktoken's GPT-2 encoding. tiktoken downloads its two files the first time: offline without them, one error
    line."""
    need_package("tiktoken", "the GPT-2 tokenizer")
    import tiktoken
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # noqa: BLE001 — reported with its cause, not hidden
        raise InputError(f"the GPT-2 tokenizer's files could not be loaded ({type(e).__name__}); connect to the "
                         "network once, or set TIKTOKEN_CACHE_DIR to a folder that holds them") from None


def check_documents(files: list[str], kind: str):
    """Each local file can be read and has a `text` column, before any tokenizer process starts (a parquet file's
    footer holds its schema; a JSON lines file is judged by its first record)."""
    for path in files:
        if kind == "parquet":
            import pyarrow.parquet as pq
            try:
                columns = pq.ParquetFile(path).schema_arrow.names
            except Exception as e:  # noqa: BLE001 — pyarrow's ArrowInvalid or OSError, reported with the file
                raise InputError(f"--input: {path} is not a readable parquet file ({type(e).__name__}: "
                                 f"{str(e).splitlines()[0] if str(e) else ''}); get it again") from None
        else:
            with open(path, encoding="utf-8", errors="replace") as f:
                first = next((line for line in f if line.strip()), "{}")
            try:
                record = json.loads(first)
            except json.JSONDecodeError:
                raise InputError(f"--input: {path}: its first line is not a JSON record; expected one JSON object "
                                 "per line") from None
            columns = list(record) if isinstance(record, dict) else []
        if "text" not in columns:
            raise InputError(f"--input: {path} has no 'text' column (it has: {', '.join(columns) or 'none'}); the "
                             "documents' text must be in a column named text")


def iter_texts(inputs: str | None):
    """Document texts, streamed: local parquet/jsonl files if `inputs` (a glob) is given, else FineWeb
    sample-10BT from the Hugging Face hub. Documents with no text are skipped. Bad inputs are reported
    here, before any tokenizer process starts; a file that breaks while read, where it breaks."""
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
        kind = kinds[exts.pop()]
        check_documents(files, kind)
        dataset = load_dataset(kind, data_files=files, split="train", streaming=True)
    else:
        dataset = load_dataset(RAW_DATASET[0], name=RAW_DATASET[1], split="train", streaming=True)
    return documents(dataset, inputs or f"{RAW_DATASET[0]} {RAW_DATASET[1]}")


def documents(dataset, source: str):
    """The texts of a streamed dataset; a read that fails part way (a damaged file, a dropped connection) is one
    error line."""
    try:
        for row in dataset:
            if row.get("text"):
                yield row["text"]
    except (KeyboardInterrupt, InputError):
        raise
    except Exception as e:  # noqa: BLE001 — the datasets/pyarrow/network error, reported with its cause
        raise InputError(f"--input: reading {source} failed ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else ''}); the complete shards are kept: fix the input "
                         "and run again to go on") from None


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
    A document that straddles a boundary is split, as llm.c and NoCap's shards are. `index`: the first shard's."""

    def __init__(self, output_dir: str, prefix: str, shard_size: int, index: int = 0):
        self.output_dir, self.prefix, self.shard_size = output_dir, prefix, shard_size
        self.buffer = np.empty(shard_size, dtype=np.uint16)
        self.filled, self.index, self.written = 0, index, []

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


def shards_of(folder: str, prefix: str) -> list[str]:
    """A set's shards in `folder`, in the order they were written (val 000000, then train 000001, ...)."""
    return sorted(glob.glob(os.path.join(folder, f"{prefix}_*.bin")), key=lambda path: path[-10:])


def tokenize_to_shards(texts, output_dir: str, prefix: str, shard_size: int, max_tokens: int | None = None,
                       workers: int | None = None, overwrite: bool = False) -> list[str]:
    """Tokenize `texts` in a process pool into shards of shard_size tokens; stop after max_tokens if given. The
    set is made in <output_dir>/.<prefix>.partial/ and moved into output_dir once complete, so that an interrupted
    run leaves nothing there that looks like a set; run again, it goes on after the complete shards it made (the
    documents come in the same order: their first tokens are skipped). A set already in output_dir is refused, or
    with overwrite replaced once the new one is complete."""
    for name, value in (("--shard_size", shard_size), ("--max_tokens", max_tokens), ("--workers", workers)):
        if value is not None and value < 1:
            raise InputError(f"{name} {value} must be >= 1")
    existing = shards_of(output_dir, prefix)
    if existing and not overwrite:
        raise InputError(f"{existing[0]} already exists; pass --overwrite to make the set again, or choose another "
                         "--output_dir or --prefix")
    gpt2_encoding()  # the tokenizer's files, before any process starts
    partial = os.path.join(output_dir, f".{prefix}.partial")
    os.makedirs(partial, exist_ok=True)
    done = [path for path in shards_of(partial, prefix) if is_complete_shard(path)]
    skip = sum(read_shard_header(path) for path in done)
    if done:
        print(f"notice: going on after an interrupted run: {len(done)} complete shard(s) of {skip:,} tokens in "
              f"{partial}", file=sys.stderr)
    writer = ShardWriter(partial, prefix, shard_size, index=len(done))
    total = stream_tokens(texts, writer, skip, max_tokens, workers)
    if total == 0:
        raise InputError("the input holds no document with text: no shard written")
    for path in existing:
        os.remove(path)  # overwrite: the new set is complete
    os.makedirs(output_dir, exist_ok=True)
    paths = [os.path.join(output_dir, os.path.basename(path)) for path in done + writer.written]
    for path in paths:
        os.replace(os.path.join(partial, os.path.basename(path)), path)
    os.rmdir(partial)
    return paths


def stream_tokens(texts, writer: ShardWriter, skip: int, max_tokens: int | None, workers: int | None) -> int:
    """Tokenize texts in a pool into the writer, leaving out the first `skip` tokens (written before) and
    anything after max_tokens; the last, shorter shard written too. Returns the tokens of the whole stream."""
    from tqdm import tqdm
    total, texts = 0, iter(texts)
    with multiprocessing.Pool(workers or max(1, os.cpu_count() - 1)) as pool, \
            tqdm(total=max_tokens, unit="tok", unit_scale=True, desc="tokenizing") as bar:
        # Feed the pool a bounded batch at a time: Pool.imap would drain a streamed dataset into memory.
        while batch := list(itertools.islice(texts, 1024)):
            for tokens in pool.imap(tokenize, batch, chunksize=16):
                if max_tokens is not None:
                    tokens = tokens[: max_tokens - total]
                writer.add(tokens[max(0, skip - total):])
                total += tokens.size
                bar.update(tokens.size)
            if max_tokens is not None and total >= max_tokens:
                break
    writer.flush()
    return total


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
    p.add_argument("--overwrite", action="store_true",
                   help="raw: make the set again where one is (it is replaced once the new one is complete)")
    args = p.parse_args(argv)

    try:
        if args.source == "cached":
            paths = download_cached(args.output_dir, args.num_train_shards)
        else:
            paths = tokenize_to_shards(iter_texts(args.input), args.output_dir, args.prefix, args.shard_size,
                                       args.max_tokens, args.workers, args.overwrite)
    except InputError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the complete shards are kept; run the same command again to go on", file=sys.stderr)
        return 130
    print(f"{len(paths)} shards in {args.output_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
