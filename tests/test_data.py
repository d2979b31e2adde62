"""Shard format, the clear errors on bad shards, and NoCap's data order (train walk and val windows)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from conftest import make_shards
from data.shards import HEADER_BYTES, SHARD_MAGIC, load_shard, read_shard_header, write_shard
from common import InputError
from model_variants import GPTConfig
from train_gpt2 import GPT, TokenLoader, ValidationSet, evaluate

CPU = torch.device("cpu")


def test_write_read_round_trip(tmp_path):
    tokens = np.random.default_rng(0).integers(0, 50257, 1000)
    path = str(tmp_path / "a.bin")
    write_shard(path, tokens)
    assert read_shard_header(path) == 1000
    header = np.fromfile(path, dtype=np.int32, count=256)
    assert list(header[:3]) == [SHARD_MAGIC, 1, 1000] and not header[3:].any()
    np.testing.assert_array_equal(load_shard(path, 50257), tokens)
    np.testing.assert_array_equal(load_shard(path, 50257, count=10), tokens[:10])
    assert not list(tmp_path.glob("*.tmp*"))  # written via a temp file that was renamed


def _corrupt(path, how):
    raw = bytearray(open(path, "rb").read())
    if how == "magic":
        raw[0:4] = np.int32(12345).tobytes()
    elif how == "version":
        raw[4:8] = np.int32(7).tobytes()
    elif how == "truncated":
        raw = raw[:-10]
    elif how == "header_only":
        raw = raw[:100]
    open(path, "wb").write(bytes(raw))


@pytest.mark.parametrize("how, message", [
    ("magic", "magic 12345 != 20240520"),
    ("version", "version 7"),
    ("truncated", "truncated or corrupt"),
    ("header_only", "shorter than the 1024-byte header"),
])
def test_bad_shards_name_the_file_and_the_fix(tmp_path, how, message):
    path = str(tmp_path / "bad.bin")
    write_shard(path, np.arange(100))
    _corrupt(path, how)
    with pytest.raises(InputError, match=message) as err:
        read_shard_header(path)
    assert path in str(err.value)
    assert "data/fineweb.py" in str(err.value) or "download it again" in str(err.value)


def test_token_beyond_vocab_is_reported_with_position(tmp_path):
    path = str(tmp_path / "v.bin")
    write_shard(path, [1, 2, 300, 4])
    with pytest.raises(InputError, match=r"token id 300 at position 2 is >= vocab_size 256"):
        load_shard(path, 256)


def test_no_matching_files_names_the_flag(tmp_path):
    with pytest.raises(InputError, match=r"--input_bin: no files match .*python data/fineweb.py"):
        TokenLoader(str(tmp_path / "nothing_*.bin"), 2, 8, 0, 1, 256, CPU)


def _reference_windows(shards, B, T, rank, world, n):
    """NoCap's loader, written out: position rank*B*T, advance by B*T*world, leave a shard when the next
    round would not fit (position + B*T*world + 1 > len), wrap around after the last shard."""
    shard, pos, out = 0, rank * B * T, []
    for _ in range(n):
        out.append(shards[shard][pos: pos + B * T + 1])
        pos += B * T * world
        if pos + B * T * world + 1 > len(shards[shard]):
            shard, pos = (shard + 1) % len(shards), rank * B * T
    return out


@pytest.mark.parametrize("rank, world", [(0, 1), (0, 2), (1, 2)])
def test_train_walk_is_nocaps_order(tmp_path, rank, world):
    train_glob, _ = make_shards(tmp_path, n_train=3, train_tokens=1000)
    shards = [load_shard(str(tmp_path / f"syn_train_{i:06d}.bin"), 256) for i in (1, 2, 3)]
    B, T = 3, 16
    loader = TokenLoader(train_glob, B, T, rank, world, 256, CPU)
    expected = _reference_windows(shards, B, T, rank, world, 60)  # wraps around all shards at least once
    for window in expected:
        x, y = loader.next_batch()
        np.testing.assert_array_equal(x.flatten().numpy(), window[:-1])
        np.testing.assert_array_equal(y.flatten().numpy(), window[1:])


def test_starting_over_after_the_last_shard_is_said_once(tmp_path, capsys):
    train_glob, _ = make_shards(tmp_path, n_train=2, train_tokens=1000)
    loader = TokenLoader(train_glob, 3, 16, 0, 1, 256, CPU)
    per_shard = (1000 - 1) // (3 * 16)  # windows before the loader moves on
    for _ in range(2 * per_shard - 1):
        loader.next_batch()
    assert "notice" not in capsys.readouterr().err  # the last window is still to come
    loader.next_batch()
    assert loader.shard == 0 and "all 2 shards (2,000 tokens) have been read" in capsys.readouterr().err
    for _ in range(3 * per_shard):  # round again: said once
        loader.next_batch()
    assert "notice" not in capsys.readouterr().err


def test_a_sample_of_rows_is_the_shards_start_and_leaves_the_walk_alone(tmp_path):
    train_glob, _ = make_shards(tmp_path, n_train=1, train_tokens=100)
    loader = TokenLoader(train_glob, 2, 16, 0, 1, 256, CPU)
    first = loader.next_batch()[0]
    shard = load_shard(str(tmp_path / "syn_train_000001.bin"), 256).astype(np.int64)
    rows = loader.sample_rows(64)  # only 6 whole rows of 16 in 100 tokens
    assert rows.shape == (6, 16) and torch.equal(rows.flatten(), torch.from_numpy(shard[:96]))
    assert (loader.batches_drawn, loader.position) == (1, 32)
    assert not torch.equal(loader.next_batch()[0], first)


def test_skip_replays_the_walk(tmp_path):
    train_glob, _ = make_shards(tmp_path, n_train=2, train_tokens=500)
    walked = TokenLoader(train_glob, 2, 16, 1, 2, 256, CPU)
    for _ in range(23):
        walked.next_batch()
    skipped = TokenLoader(train_glob, 2, 16, 1, 2, 256, CPU)
    skipped.skip(23)
    assert skipped.batches_drawn == walked.batches_drawn == 23
    for _ in range(5):
        torch.testing.assert_close(skipped.next_batch(), walked.next_batch())


def test_prefetched_batches_are_the_walks_and_leave_it_alone(tmp_path):
    # The trainer prefetches after each micro-batch: the batches are the same as without, the walk's state (what
    # a checkpoint keeps) does not move until the batch is handed out, and a staged batch that the walk has
    # moved past (a skip, a restored position) is never handed out.
    train_glob, _ = make_shards(tmp_path, n_train=2, train_tokens=500)
    def make():
        return TokenLoader(train_glob, 2, 16, 0, 1, 256, CPU)
    plain, prefetching = make(), make()
    reads = []
    read = prefetching._read_batch
    prefetching._read_batch = lambda: reads.append(prefetching.position) or read()
    for n in range(40):  # past the end of the first shard
        prefetching.prefetch()
        state = (prefetching.shard, prefetching.position, prefetching.batches_drawn)
        prefetching.prefetch()  # a second call stages nothing new
        assert (prefetching.shard, prefetching.position, prefetching.batches_drawn) == state
        torch.testing.assert_close(prefetching.next_batch(), plain.next_batch())
    assert len(reads) == 40  # every batch was read once, when it was prefetched
    prefetching.prefetch()
    prefetching.skip(3)
    plain.skip(3)
    torch.testing.assert_close(prefetching.next_batch(), plain.next_batch())


def test_shard_smaller_than_a_batch_round_is_refused(tmp_path):
    train_glob, _ = make_shards(tmp_path, n_train=1, train_tokens=100)
    with pytest.raises(InputError, match="fewer than one batch round"):
        TokenLoader(train_glob, 4, 32, 0, 1, 256, CPU)


def test_validation_windows_cover_the_first_val_tokens_once_across_ranks(tmp_path):
    _, val_glob = make_shards(tmp_path, val_tokens=5000)
    tokens = load_shard(str(tmp_path / "syn_val_000000.bin"), 256)
    B, T, val_tokens = 2, 16, 512
    single = [x for x, _ in ValidationSet(val_glob, val_tokens, B, T, 0, 1, 256, CPU)]
    np.testing.assert_array_equal(torch.cat(single).flatten().numpy(), tokens[:val_tokens])
    halves = [list(ValidationSet(val_glob, val_tokens, B, T, r, 2, 256, CPU)) for r in (0, 1)]
    interleaved = [batch for pair in zip(*halves) for batch in pair]  # NoCap: batch k of rank r = k*world + r
    for (x, y), (x1, y1) in zip(interleaved, ValidationSet(val_glob, val_tokens, B, T, 0, 1, 256, CPU)):
        torch.testing.assert_close((x, y), (x1, y1))
    assert torch.equal(single[-1][-1, -1], torch.tensor(int(tokens[val_tokens - 1])))


def test_validation_errors(tmp_path):
    _, val_glob = make_shards(tmp_path, val_tokens=600)
    with pytest.raises(InputError, match=r"fewer than --val_tokens 1,024 \+ 1"):
        ValidationSet(val_glob, 1024, 2, 16, 0, 1, 256, CPU)
    with pytest.raises(InputError, match="not a whole number of validation rows of 16 tokens; pass a multiple of 16 "
                                         r"\(e.g. 496\)"):
        ValidationSet(val_glob, 500, 2, 16, 0, 1, 256, CPU)


def test_validation_tokens_that_do_not_fill_the_last_round_are_scored_in_a_smaller_one(tmp_path):
    """7 rows in rounds of 2 x 2 processes: rank 0 scores rows 0-1 and 4-5, rank 1 rows 2-3 and 6 (a batch of one
    row); alone, one process scores every row, its last batch of 1; the loss is the mean over every token."""
    _, val_glob = make_shards(tmp_path, val_tokens=5000)
    tokens = load_shard(str(tmp_path / "syn_val_000000.bin"), 256)
    T = 16
    rank0, rank1 = (list(ValidationSet(val_glob, 7 * T, 2, T, r, 2, 256, CPU)) for r in (0, 1))
    assert [x.shape[0] for x, _ in rank0] == [2, 2] and [x.shape[0] for x, _ in rank1] == [2, 1]
    rows = torch.cat([rank0[0][0], rank1[0][0], rank0[1][0], rank1[1][0]])
    np.testing.assert_array_equal(rows.flatten().numpy(), tokens[:7 * T])
    three = ValidationSet(val_glob, 5 * T, 1, T, 2, 3, 256, CPU)  # rounds of 3 rows: rank 2 has none in the last
    assert [b is None for b in three] == [False, True] and three.steps == 2
    alone = ValidationSet(val_glob, 7 * T, 4, T, 0, 1, 256, CPU)
    assert [x.shape[0] for x, _ in alone] == [4, 3] and [x.shape for x, _ in alone.shapes()] == [(4, T), (3, T)]
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=1, n_head=2, n_embd=16, vocab_size=256, block_size=T))
    per_token = torch.cat([F.cross_entropy(model(x, y)[0].flatten(0, 1), y.flatten(), reduction="none")
                           for x, y in ValidationSet(val_glob, 7 * T, 7, T, 0, 1, 256, CPU)])
    assert evaluate(model, alone, 1) == pytest.approx(per_token.mean().item(), rel=1e-6)
    assert HEADER_BYTES == 1024
