"""data/fineweb.py: raw tokenization equals tiktoken's, shard packing, and the cached download's
skip / verify / atomic-replace logic (with a local stand-in for the hub)."""

import json
import os
import shutil
import sys

import numpy as np
import pytest

from conftest import REPO, SHARED_DATA

sys.path.insert(0, str(REPO / "data"))
import fineweb  # noqa: E402
from data.shards import load_shard, read_shard_header, write_shard  # noqa: E402
from common import InputError  # noqa: E402

PARQUET = SHARED_DATA / "fineweb_sample" / "fineweb_sample_3100docs.parquet"


def gpt2_encoder():
    tiktoken = pytest.importorskip("tiktoken")
    try:
        return tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network and no ../shared copy of the BPE files
        pytest.skip(f"tiktoken's GPT-2 files are unavailable offline ({type(e).__name__})")


def expected_stream(texts, enc):
    return np.concatenate([[fineweb.EOT] + enc.encode_ordinary(t) for t in texts])


def test_jsonl_documents_tokenize_to_tiktokens_ids(tmp_path):
    enc = gpt2_encoder()
    texts = ["Hello world", "Second <|endoftext|> doc, with special text kept as text.", "", "ünïcödé ✓"]
    with open(tmp_path / "docs.jsonl", "w") as f:
        for t in texts:
            f.write(json.dumps({"text": t, "id": 1}) + "\n")
    paths = fineweb.tokenize_to_shards(fineweb.iter_texts(str(tmp_path / "docs.jsonl")), str(tmp_path / "out"),
                                       "t", shard_size=10, workers=2)
    got = np.concatenate([load_shard(p, 50257) for p in paths])
    np.testing.assert_array_equal(got, expected_stream([t for t in texts if t], enc))  # empty doc skipped
    assert [p.rsplit("/", 1)[1] for p in paths][:2] == ["t_val_000000.bin", "t_train_000001.bin"]
    assert all(read_shard_header(p) == 10 for p in paths[:-1]) and read_shard_header(paths[-1]) <= 10


@pytest.mark.skipif(not PARQUET.exists(), reason="needs ../shared/data/fineweb_sample (the real FineWeb sample)")
def test_real_fineweb_parquet_tokenizes_to_tiktokens_ids(tmp_path):
    enc = gpt2_encoder()
    import pyarrow.parquet as pq
    texts = [t for t in pq.read_table(PARQUET, columns=["text"]).column("text").to_pylist()[:600] if t]
    budget = 150_000
    paths = fineweb.tokenize_to_shards(fineweb.iter_texts(str(PARQUET)), str(tmp_path), "fw", shard_size=60_000,
                                       max_tokens=budget, workers=2)
    got = np.concatenate([load_shard(p, 50257) for p in paths])
    assert got.size == budget and [read_shard_header(p) for p in paths] == [60_000, 60_000, 30_000]
    np.testing.assert_array_equal(got, expected_stream(texts, enc)[:budget])


def test_raw_tokenization_without_datasets_is_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if not installed: it is an extra
    assert fineweb.main(["--source", "raw", "--input", str(tmp_path / "*.jsonl"), "--output_dir",
                         str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("error: --source raw (it reads documents with the datasets package) needs "
                                       "datasets, which is not installed: pip install datasets\n")
    assert not (tmp_path / "out").exists()


def test_shard_writer_splits_documents_across_shards(tmp_path):
    writer = fineweb.ShardWriter(str(tmp_path), "w", shard_size=4)
    for doc in ([1, 2, 3], [4, 5, 6, 7, 8], [9]):
        writer.add(np.array(doc, dtype=np.uint16))
    writer.flush()
    assert [load_shard(p, 100).tolist() for p in writer.written] == [[1, 2, 3, 4], [5, 6, 7, 8], [9]]


def test_raw_refuses_to_overwrite_existing_shards_unless_asked(tmp_path):
    gpt2_encoder()
    write_shard(str(tmp_path / "fw_val_000000.bin"), [1, 2])
    with pytest.raises(InputError, match="already exists; pass --overwrite to make the set again"):
        fineweb.tokenize_to_shards(iter(["x"]), str(tmp_path), "fw", shard_size=10)
    assert load_shard(str(tmp_path / "fw_val_000000.bin"), 10).tolist() == [1, 2]
    paths = fineweb.tokenize_to_shards(iter(["x"]), str(tmp_path), "fw", shard_size=10, workers=1, overwrite=True)
    assert [os.path.basename(p) for p in paths] == ["fw_val_000000.bin"]
    assert load_shard(paths[0], 50257).tolist() == [fineweb.EOT, 87]  # <|endoftext|> "x"


def interrupted_after(texts, n):
    """The texts, as a stream that Ctrl-C stops after n documents."""
    for i, text in enumerate(texts):
        if i == n:
            raise KeyboardInterrupt
        yield text


def test_an_interrupted_tokenization_leaves_no_set_and_goes_on_where_it_stopped(tmp_path):
    gpt2_encoder()
    texts = [f"document {i}: " + "word " * (i % 7) for i in range(3000)]
    whole = fineweb.tokenize_to_shards(iter(texts), str(tmp_path / "whole"), "fw", shard_size=3000, workers=2)
    with pytest.raises(KeyboardInterrupt):
        fineweb.tokenize_to_shards(interrupted_after(texts, 2500), str(tmp_path / "out"), "fw", shard_size=3000,
                                   workers=2)
    assert not fineweb.shards_of(str(tmp_path / "out"), "fw")  # nothing that looks like a set
    kept = fineweb.shards_of(str(tmp_path / "out" / ".fw.partial"), "fw")
    assert 0 < len(kept) < len(whole)
    paths = fineweb.tokenize_to_shards(iter(texts), str(tmp_path / "out"), "fw", shard_size=3000, workers=2)
    assert [os.path.basename(p) for p in paths] == [os.path.basename(p) for p in whole]
    for mine, straight in zip(paths, whole):
        np.testing.assert_array_equal(load_shard(mine, 50257), load_shard(straight, 50257))
    assert not (tmp_path / "out" / ".fw.partial").exists()


def test_raw_input_errors(tmp_path):
    with pytest.raises(InputError, match="no files match"):
        fineweb.iter_texts(str(tmp_path / "none*.parquet"))
    (tmp_path / "a.txt").write_text("x")
    with pytest.raises(InputError, match="only .parquet or only .jsonl"):
        fineweb.iter_texts(str(tmp_path / "a.txt"))


@pytest.mark.parametrize("damage, message", [
    ("no text", "has no 'text' column (it has: body, id); the documents' text must be in a column named text"),
    ("truncated", "is not a readable parquet file (ArrowInvalid: "),
    ("garbled", "is not a readable parquet file ("),
])
def test_a_bad_parquet_is_one_line(tmp_path, capsys, damage, message):
    pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq
    path = tmp_path / "docs.parquet"
    column = "body" if damage == "no text" else "text"
    pq.write_table(pa.table({column: ["one document", "another"], "id": [1, 2]}), path)
    data = path.read_bytes()
    if damage == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "garbled":
        path.write_bytes(data[:8] + bytes(b ^ 0x5A for b in data[8:-8]) + data[-8:])
    assert fineweb.main(["--source", "raw", "--input", str(path), "--output_dir", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --input: {path} {message}") and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_without_the_tokenizers_files_is_one_line(tmp_path, capsys, monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")

    def offline(name):
        raise ConnectionError("no network")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    assert fineweb.main(["--source", "raw", "--input", str(tmp_path / "docs.jsonl"), "--output_dir",
                         str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("error: the GPT-2 tokenizer's files could not be loaded (ConnectionError); "
                                       "connect to the network once, or set TIKTOKEN_CACHE_DIR to a folder that "
                                       "holds them\n")


@pytest.mark.parametrize("flag, value", [("--max_tokens", "-5"), ("--workers", "-1"), ("--shard_size", "0")])
def test_bad_numbers_are_one_line(tmp_path, capsys, flag, value):
    (tmp_path / "docs.jsonl").write_text(json.dumps({"text": "hi"}) + "\n")
    assert fineweb.main(["--source", "raw", "--input", str(tmp_path / "docs.jsonl"), "--output_dir",
                         str(tmp_path / "out"), flag, value]) == 2
    assert capsys.readouterr().err == f"error: {flag} {value} must be >= 1\n"


# --- --source cached -----------------------------------------------------------------------------------

class FakeHub:
    """Serves shards from a local folder the way hf_fetch does (a file inside dest_dir), counting calls."""

    def __init__(self, folder):
        self.folder, self.fetched = folder, []

    def __call__(self, name, dest_dir):
        self.fetched.append(name)
        shutil.copy(self.folder / name, f"{dest_dir}/{name}")
        return f"{dest_dir}/{name}"


@pytest.fixture
def hub(tmp_path):
    folder = tmp_path / "hub"
    folder.mkdir()
    rng = np.random.default_rng(0)
    for name in fineweb.cached_shard_names(3):
        write_shard(str(folder / name), rng.integers(0, 50257, 500))
    return FakeHub(folder)


def test_cached_download_fetches_verifies_and_skips_complete_files(tmp_path, hub):
    out = tmp_path / "fineweb10B"
    paths = fineweb.download_cached(str(out), 2, fetch=hub)
    assert [p.rsplit("/", 1)[1] for p in paths] == ["fineweb_val_000000.bin", "fineweb_train_000001.bin",
                                                    "fineweb_train_000002.bin"]
    for p in paths:
        assert open(p, "rb").read() == (hub.folder / p.rsplit("/", 1)[1]).read_bytes()
    assert sorted(x.name for x in out.iterdir()) == sorted(p.rsplit("/", 1)[1] for p in paths)  # no scratch left

    hub.fetched.clear()
    (out / "fineweb_train_000002.bin").write_bytes((out / "fineweb_train_000002.bin").read_bytes()[:-7])  # torn
    fineweb.download_cached(str(out), 3, fetch=hub)
    assert hub.fetched == ["fineweb_train_000002.bin", "fineweb_train_000003.bin"]  # complete ones skipped
    assert read_shard_header(str(out / "fineweb_train_000002.bin")) == 500


def test_cached_download_rejects_a_bad_file_and_keeps_the_old_one(tmp_path, hub):
    out = tmp_path / "fineweb10B"
    out.mkdir()
    (out / "fineweb_val_000000.bin").write_bytes(b"partial")
    (hub.folder / "fineweb_val_000000.bin").write_bytes(b"<html>rate limited</html>")
    with pytest.raises(InputError, match="downloaded fineweb_val_000000.bin is not a valid shard"):
        fineweb.download_cached(str(out), 1, fetch=hub)
    assert (out / "fineweb_val_000000.bin").read_bytes() == b"partial"
    assert sorted(x.name for x in out.iterdir()) == [".download", "fineweb_val_000000.bin"]
    assert list((out / ".download").iterdir()) == []  # the bad file is not kept for a resume


def test_a_broken_transfer_is_resumed_by_the_next_run(tmp_path, hub):
    out = tmp_path / "fineweb10B"
    seen = []

    def breaks_once(name, dest_dir):
        partial = os.path.join(dest_dir, ".cache", f"{name}.incomplete")  # where huggingface_hub keeps it
        seen.append(os.path.exists(partial))
        if len(seen) == 1:  # the first transfer breaks
            os.makedirs(os.path.dirname(partial))
            open(partial, "wb").write(b"the first megabytes")
            raise InputError(f"{name}: download failed (ConnectionError)")
        return hub(name, dest_dir)
    with pytest.raises(InputError, match="download failed"):
        fineweb.download_cached(str(out), 1, fetch=breaks_once)
    fineweb.download_cached(str(out), 1, fetch=breaks_once)
    assert seen[:2] == [False, True]  # the retry found the partial file to resume from
    assert sorted(p.name for p in out.iterdir()) == ["fineweb_train_000001.bin", "fineweb_val_000000.bin"]


def test_the_free_disk_is_checked_before_anything_is_fetched(tmp_path, hub, monkeypatch):
    import collections
    monkeypatch.setattr(fineweb.shutil, "disk_usage", lambda path: collections.namedtuple("u", "free")(3 * 10**8))
    with pytest.raises(InputError, match=r"the 3 shards to download need 0.6 GB and 0.3 GB is free; free some"):
        fineweb.download_cached(str(tmp_path / "fw"), 2, fetch=hub)
    assert hub.fetched == []


@pytest.mark.parametrize("n", [0, 104])
def test_cached_shard_count_is_bounded(tmp_path, n):
    with pytest.raises(InputError, match="train shards 1..103"):
        fineweb.download_cached(str(tmp_path), n, fetch=None)


def test_cli_reports_errors_in_one_line(tmp_path, capsys):
    assert fineweb.main(["--source", "raw", "--input", str(tmp_path / "none*.jsonl"),
                         "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: --input: no files match")


def test_a_failed_transfer_is_one_line_and_leaves_nothing(tmp_path, capsys, monkeypatch):
    import huggingface_hub

    def offline(**kwargs):
        raise OSError("Connection refused\nmore detail")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    assert fineweb.main(["-n", "1", "--output_dir", str(tmp_path / "fw")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("error: fineweb_val_000000.bin: download from kjj0/fineweb10B-gpt2 failed (OSError: "
                       "Connection refused); check the network (or HF_ENDPOINT) and run again — complete shards "
                       "are kept")
    assert [p.name for p in (tmp_path / "fw").iterdir()] == [".download"]  # no shard: only where a retry resumes


def test_getting_shards_does_not_import_torch(tmp_path):
    # The download and the tokenizer need the shard format, not the trainer: a data machine needs no torch.
    import subprocess
    code = ("import sys, fineweb; assert 'torch' not in sys.modules, 'torch imported'; "
            f"sys.exit(fineweb.main(['--source', 'raw', '--input', {str(tmp_path / 'none*.jsonl')!r}]))")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO / "data", capture_output=True, text=True)
    assert result.returncode == 2 and "torch imported" not in result.stderr
    assert result.stderr.strip().startswith("error: ")  # no such files (or, without datasets, its install line)
