"""Generation: each new token is the model's own choice over the whole sequence for every attention kind, greedy
decoding is deterministic, and scripts/sample.py prints text from a trained checkpoint."""

import sys
from dataclasses import replace

import pytest
import torch

from conftest import REPO, make_shards, tiny_run_args
from model_variants import TINY, with_overrides
from train_gpt2 import GPT
from train_gpt2 import main as train_main

sys.path.insert(0, str(REPO / "scripts"))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # unfused on CPU, expected
@pytest.mark.parametrize("changes", [
    {}, dict(n_kv_head=2), dict(n_kv_head=1), dict(kv_lora_rank=16),
    dict(window=5, window_pattern="LG"), dict(moe_experts=4, moe_topk=2),
    dict(qk_norm=True, logit_softcap=15.0), dict(attn_impl="flex", window=4),
    dict(window=5, window_pattern="LG", window_kind="chunked"),
])
def test_each_generated_token_is_the_most_likely_one_given_the_sequence_so_far(changes):
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, block_size=48, **changes)).eval()
    prompt = torch.randint(0, 64, (2, 7))
    greedy = model.generate(prompt, 20, temperature=0)
    assert torch.equal(greedy[:, :7], prompt) and greedy.shape == (2, 27)
    with torch.no_grad():  # the training forward's logits over the whole result: position t chose token t + 1
        logits = model(greedy[:, :-1], greedy[:, 1:])[0]
    assert torch.equal(logits[:, 6:].argmax(dim=-1), greedy[:, 7:])
    assert torch.equal(model.generate(prompt, 20, temperature=1.0, top_k=1), greedy)  # top 1 of any softmax
    sampled = [model.generate(prompt, 20, temperature=1.0, top_k=10, generator=torch.Generator().manual_seed(3))
               for _ in range(2)]
    assert torch.equal(*sampled) and not torch.equal(sampled[0], greedy)


def test_greedy_sample_of_a_trained_model_is_deterministic_and_learned(tmp_path, capsys):
    # A sequence that repeats 0..15: after training, greedy decoding continues the cycle.
    argv = tiny_run_args(make_shards(tmp_path / "data", cyclic=True), tmp_path, "cyc",
                         "--num_iterations", "60", "--learning_rate", "1e-2")
    assert train_main(argv) == 0
    ckpt = torch.load(next((tmp_path / "cyc").glob("ckpt_*.pt")), weights_only=True)
    model = GPT(replace(TINY, **{k: v for k, v in ckpt["model_config"].items()}))
    model.load_state_dict(ckpt["model"])
    prompt = torch.tensor([[3, 4, 5, 6]])
    first = model.generate(prompt, 12, temperature=0)
    assert torch.equal(first, model.generate(prompt, 12, temperature=0))
    assert first[0, 4:].tolist() == [(7 + i) % 16 for i in range(12)]


def test_sample_script_prints_text(tmp_path, shards, capsys):
    tiktoken = pytest.importorskip("tiktoken")
    try:
        tiktoken.get_encoding("gpt2")
    except Exception as e:
        pytest.skip(f"tiktoken's GPT-2 files are unavailable offline ({type(e).__name__})")
    import sample
    argv = tiny_run_args(shards, tmp_path, "run", "--vocab_size", "50257")
    assert train_main(argv) == 0
    ckpt = str(next((tmp_path / "run").glob("ckpt_*.pt")))
    capsys.readouterr()
    assert sample.main(["--checkpoint", ckpt, "--prompt", "Hello", "--max_new_tokens", "5", "--num_samples", "2",
                        "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("--- sample") == 2 and out.splitlines()[1].startswith("Hello")
    assert sample.main(["--checkpoint", ckpt, "--max_new_tokens", "5000", "--device", "cpu"]) == 2
    assert "exceeds the model's block_size" in capsys.readouterr().err


def test_sample_script_offline_without_the_tokenizer_files_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    import sample

    def offline(name):
        raise ConnectionError("Max retries exceeded with url: openaipublic.blob.core.windows.net")
    monkeypatch.setattr(tiktoken, "get_encoding", offline)
    assert sample.main(["--checkpoint", str(tmp_path / "any.pt"), "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: the GPT-2 tokenizer's files could not be loaded (ConnectionError); connect to the network "
                   "once, or set TIKTOKEN_CACHE_DIR to a folder that holds them"]


@pytest.mark.parametrize("flags, message", [
    (["--top_k", "-5"], "--top_k -5 must be >= 0 (0: all tokens)"),
    (["--num_samples", "0"], "--num_samples 0 must be >= 1"),
    (["--max_new_tokens", "-5"], "--max_new_tokens -5 must be >= 1"),
    (["--temperature", "nan"], "--temperature nan must be a finite number >= 0 (0: greedy)"),
    (["--temperature", "-1"], "--temperature -1.0 must be a finite number >= 0 (0: greedy)"),
])
def test_sample_scripts_bad_numbers_are_one_line(tmp_path, capsys, flags, message):
    import sample
    assert sample.main(["--checkpoint", str(tmp_path / "any.pt"), "--device", "cpu", *flags]) == 2
    assert capsys.readouterr().err == f"error: {message}\n"
