"""The bundled sample (data/sample) is valid, small, real text, and trains out of the box."""

import json

import pytest

from conftest import REPO
from data.shards import load_shard
from train_gpt2 import main

SAMPLE = REPO / "data" / "sample"


def test_sample_is_small_valid_and_attributed():
    shards = sorted(SAMPLE.glob("sample_*.bin"))
    assert [p.name for p in shards] == ["sample_train_000001.bin", "sample_train_000002.bin",
                                        "sample_val_000000.bin"]
    assert sum(p.stat().st_size for p in shards) <= 3_000_000
    for p in shards:
        tokens = load_shard(str(p), 50257)
        assert tokens.size == 400_000
    assert "ODC-By" in (SAMPLE / "README.md").read_text()


def test_sample_decodes_to_english_documents():
    tiktoken = pytest.importorskip("tiktoken")
    try:
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:
        pytest.skip(f"tiktoken's GPT-2 files are unavailable offline ({type(e).__name__})")
    tokens = load_shard(str(SAMPLE / "sample_val_000000.bin"), 50257)
    assert tokens[0] == 50256 and (tokens == 50256).sum() > 50  # many documents, each after <|endoftext|>
    text = enc.decode(tokens[1:2000].tolist())
    assert sum(word in text.split() for word in ("the", "and", "of", "to")) == 4


def test_tiny_model_trains_on_the_sample(tmp_path, capsys):
    code = main(["--model", "tiny", "--device", "cpu", "--input_bin", str(SAMPLE / "sample_train_*.bin"),
                 "--input_val_bin", str(SAMPLE / "sample_val_000000.bin"), "--batch_size", "4",
                 "--sequence_length", "64", "--grad_accumulation_steps", "1", "--num_iterations", "30",
                 "--learning_rate", "3e-3", "--warmup_iters", "3", "--warmdown_iters", "5",
                 "--val_loss_every", "30", "--val_batch_size", "4", "--val_tokens", "4096",
                 "--target_val_loss", "0", "--output_dir", str(tmp_path), "--run_name", "demo"])
    assert code == 0
    records = [json.loads(line) for line in open(tmp_path / "demo" / "metrics.jsonl")]
    vals = [r["val_loss"] for r in records if "val_loss" in r]
    assert vals[0] > 10.5 and vals[-1] < vals[0] - 2.0  # from ln(50257) = 10.8 to well below
