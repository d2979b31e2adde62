"""Schedules over the steps of a run beyond the learning rate: the attention-window warmup and the sampled
softmax's span, each checked for what it schedules, what a run then computes, and its flags' errors."""

import json
from argparse import Namespace

import numpy as np
import pytest
import torch

import train_gpt2
from conftest import count_compiles, make_shards, read_metrics, tiny_run_args, train_flags
from model_variants import TINY, VARIANTS, with_overrides
from train_gpt2 import GPT, main, softmax_sample, warm_up_steps
from schedule import Schedule, lr_scale


def parse(*flags) -> Namespace:
    return train_flags(*flags)


def record_training_passes(monkeypatch, pick) -> list:
    """What pick(the keyword arguments) makes of every training forward pass of the model, in order."""
    seen = []
    forward = GPT.forward

    def recording_forward(self, idx, targets=None, **kwargs):
        if self.training:
            seen.append(pick(kwargs))
        return forward(self, idx, targets, **kwargs)
    monkeypatch.setattr(GPT, "forward", recording_forward)
    return seen


# --- the attention-window warmup -------------------------------------------------------------------------------

def test_window_warmup_doubles_the_local_window_in_equal_stages():
    config = VARIANTS["d12_fast"]  # window 256 in three of four layers
    args = parse("--window_iters", "90")
    windows = [Schedule.of(args, config.window).at(step).local_window for step in range(120)]
    assert windows[:45] == [64] * 45 and windows[45:90] == [128] * 45 and windows[90:] == [256] * 30
    assert {Schedule.of(parse(), config.window).at(step).local_window for step in range(100)} == {256}
    # With a curriculum beside it (rows of 256, 512, 1024), a graph for every (row length, window) the run meets:
    both = parse("--window_iters", "90", "--curriculum_iters", "60")
    assert warm_up_steps(Schedule.of(both, config.window)) == [step for step in (0, 30, 45, 60, 90) for _ in range(3)]


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("impl", ["manual", "flex"])
def test_a_local_window_replaces_the_local_layers_window_in_training_only(impl):
    torch.manual_seed(0)
    config = with_overrides(TINY, vocab_size=64, n_layer=4, window=16, window_pattern="LG", attn_impl=impl)
    model = GPT(config)
    narrow = GPT(with_overrides(config, window=4))
    narrow.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, 32))
    with torch.no_grad():  # FlexAttention has no backward on a CPU; its masks come from the forward's windows
        torch.testing.assert_close(model(idx, idx, local_window=4)[1], narrow(idx, idx)[1])
        assert not torch.allclose(model(idx, idx)[1], narrow(idx, idx)[1])  # the windows matter at this length
        model.eval()
        torch.testing.assert_close(model(idx, idx, local_window=4)[1], model(idx, idx)[1])  # evaluation: full window


def test_a_window_warmup_run_attends_with_the_scheduled_window(tmp_path, shards, capsys, monkeypatch):
    import train_gpt2
    seen = []
    chunked_attention = train_gpt2.chunked_attention

    def recording(q, k, v, impl, chunk):  # the local layers' path (window_kind chunked)
        seen.append((torch.is_grad_enabled(), chunk))
        return chunked_attention(q, k, v, impl, chunk)
    monkeypatch.setattr(train_gpt2, "chunked_attention", recording)
    extra = ["--window", "16", "--window_pattern", "LG", "--window_kind", "chunked", "--window_iters", "4",
             "--val_loss_every", "6"]
    assert main(tiny_run_args(shards, tmp_path, "run", *extra)) == 0
    capsys.readouterr()
    # 6 steps x 2 micro-batches through the one local layer; stages of 2 steps at 4 and 8, then 16.
    assert [chunk for grad, chunk in seen if grad] == [4] * 4 + [8] * 4 + [16] * 4
    assert {chunk for grad, chunk in seen if not grad} == {16}  # evaluations use the full window


def test_window_warmup_flags_are_checked_against_the_model(tmp_path, shards, capsys):
    def error(*extra):
        assert main(tiny_run_args(shards, tmp_path, "run", *extra)) == 2
        return capsys.readouterr().err.strip().splitlines()
    assert error("--window_iters", "2") == [
        "error: --window_iters 2: --model tiny has no local attention layers (window 0) to warm up; pass --window W, "
        "or drop --window_iters"]
    assert error("--window", "18", "--window_iters", "2") == [
        "error: --window_iters starts at a quarter of --window 18: pass a multiple of 4"]
    assert error("--window", "16", "--window_iters", "99") == [
        "error: --window_iters 99: pass the step (1 to --num_iterations 6) at which the schedule reaches --window, "
        "or 0 for none"]
    assert not (tmp_path / "run").exists()


def test_the_sampled_softmax_draws_by_seed_step_and_micro_batch():
    from types import SimpleNamespace
    args, weights = parse("--sampled_softmax", "32"), torch.zeros(256)
    # one softmax over the whole run: one graph
    assert warm_up_steps(Schedule.of(args, VARIANTS["d12"].window)) == [0, 0, 0]
    env = SimpleNamespace(device=torch.device("cpu"), rank=0)
    first = softmax_sample(7, 1, args, 256, env, weights)
    assert first.columns == 32 and first.draws.shape == (256,)
    assert torch.equal(first.draws, softmax_sample(7, 1, args, 256, env, weights).draws)  # a resumed run: the same
    others = [softmax_sample(7, 0, args, 256, env, weights), softmax_sample(8, 1, args, 256, env, weights),
              softmax_sample(7, 1, parse("--sampled_softmax", "32", "--seed", "1"), 256, env, weights),
              softmax_sample(7, 1, args, 256, SimpleNamespace(device=env.device, rank=1), weights)]
    assert not any(torch.equal(first.draws, other.draws) for other in others)
    assert softmax_sample(7, 0, parse(), 256, env, weights) is None
    # With --sampled_softmax_tokens, a micro-batch of two groups draws what two micro-batches of one would.
    grouped = parse("--sampled_softmax", "32", "--sampled_softmax_tokens", "64")
    pair = softmax_sample(7, 1, grouped, 256, env, weights, micro_tokens=128)
    assert pair.draws.shape == (2, 256)
    assert torch.equal(pair.draws[0], softmax_sample(7, 2, grouped, 256, env, weights, micro_tokens=64).draws)
    assert torch.equal(pair.draws[1], softmax_sample(7, 3, grouped, 256, env, weights, micro_tokens=64).draws)


def test_a_sampled_softmax_run_samples_every_step_and_says_what_its_training_loss_is(tmp_path, shards, capsys,
                                                                                        monkeypatch):
    seen = record_training_passes(
        monkeypatch, lambda kwargs: None if kwargs["sampled_softmax"] is None else kwargs["sampled_softmax"].columns)
    assert main(tiny_run_args(shards, tmp_path, "run", "--sampled_softmax", "64")) == 0
    out = capsys.readouterr().out
    assert seen == [64] * 12  # 6 steps of 2 micro-batches
    assert ("sampled softmax: 64 of 256 columns (drawn by the counts in the first 40,000 training tokens), against "
            "the ") in out
    assert ("distinct tokens of the first micro-batch; their logged training loss is that softmax's estimate of "
            "the full one (evaluation always scores the full softmax)") in out
    steps = [r for r in read_metrics(tmp_path / "run") if "train_loss" in r]
    assert len(steps) == 6 and all(0 < r["train_loss"] < 10 for r in steps)


def test_frequency_draws_weigh_each_token_by_its_count_in_the_first_training_tokens(tmp_path, shards, capsys,
                                                                                    monkeypatch):
    import glob
    from data.shards import load_shard
    weights = record_training_passes(monkeypatch, lambda kwargs: kwargs["sampled_softmax"].log_weights)
    monkeypatch.setattr(train_gpt2, "FREQUENCY_COUNT_TOKENS", 25_000)  # the first shard and 5,000 of the second's
    assert main(tiny_run_args(shards, tmp_path, "run", "--sampled_softmax", "64")) == 0
    out, err = capsys.readouterr()
    assert "sampled softmax: 64 of 256 columns (drawn by the counts in the first 25,000 training tokens)" in out
    assert "the training data holds" not in err  # the data holds more than the counted tokens: no notice
    first, second = (load_shard(path, 256) for path in sorted(glob.glob(shards[0])))
    counts = np.bincount(np.concatenate([first, second[:5_000]]), minlength=256)
    assert len(weights) == 12 and all(w is weights[0] for w in weights)
    torch.testing.assert_close(weights[0], torch.from_numpy(np.log1p(counts)).float())
    # The counts do not depend on where the walk is (a resumed run's loader starts further on).
    loader = train_gpt2.TokenLoader(shards[0], 2, 32, 0, 1, 256, torch.device("cpu"))
    loader.skip(400)
    assert loader.shard == 1 and np.array_equal(loader.token_counts(25_000), counts)
    # Nor on the shards after the counted tokens: the same data with a third shard staged counts the same.
    three, _ = make_shards(tmp_path / "three", n_train=3)
    assert len(glob.glob(three)) == 3
    more = train_gpt2.TokenLoader(three, 2, 32, 0, 1, 256, torch.device("cpu"))
    assert np.array_equal(more.token_counts(25_000), counts)


def test_frequency_draws_on_less_data_than_they_count_say_so(tmp_path, shards, capsys):
    assert main(tiny_run_args(shards, tmp_path, "run", "--sampled_softmax", "64")) == 0  # the shards hold 40,000
    out, err = capsys.readouterr()
    assert "(drawn by the counts in the first 40,000 training tokens)" in out
    assert ("notice: --sampled_softmax: the training data holds 40,000 tokens, fewer than the 40,000,000 whose "
            "counts weigh the draws, so its draws differ from a run on more data") in err


def test_a_compiled_sampled_softmax_run_builds_its_graph_in_the_warm_up(tmp_path, shards, capsys, monkeypatch):
    counter, after_warm_up = count_compiles(monkeypatch)
    flags = ("--compile", "--sampled_softmax", "64")
    assert main(tiny_run_args(shards, tmp_path, "run", *flags)) == 0
    assert "graph break" not in capsys.readouterr().err
    assert counter.frame_count == after_warm_up[0] > 0  # nothing compiled in the timed steps


def test_a_micro_batch_with_more_distinct_tokens_than_columns_gets_a_notice(tmp_path, shards, capsys):
    import glob
    from data.shards import load_shard
    first = load_shard(sorted(glob.glob(shards[0]))[0], 256)[:2 * 32]  # the first micro-batch: 2 rows of 32
    distinct = len(set(first.tolist()))
    assert 16 < distinct <= 64
    for columns, warned in ((16, True), (64, False)):
        flags = ("--sampled_softmax", str(columns), "--num_iterations", "2",
                 "--warmup_iters", "0", "--warmdown_iters", "1")
        assert main(tiny_run_args(shards, tmp_path, f"k{columns}", *flags)) == 0
        captured = capsys.readouterr()
        assert f"the {distinct} distinct tokens of the first micro-batch" in captured.out
        notice = (f"notice: --sampled_softmax 16: {distinct} distinct tokens in the first micro-batch, more than "
                  "the columns, so the positions whose target is left out are not trained on; raise "
                  "--sampled_softmax above them or lower --batch_size")
        assert (notice in captured.err) == warned
    # With a sample per 32 tokens, the first 32 are what one sample's columns must hold.
    distinct = len(set(first[:32].tolist()))
    assert 16 < distinct <= 32
    assert main(tiny_run_args(shards, tmp_path, "g16", "--sampled_softmax", "16", "--num_iterations", "2",
                              "--warmup_iters", "0", "--warmdown_iters", "1", "--sampled_softmax_tokens", "32")) == 0
    captured = capsys.readouterr()
    assert f"the {distinct} distinct tokens of the first 32 tokens" in captured.out
    assert (f"notice: --sampled_softmax 16: {distinct} distinct tokens in the first 32 tokens, more than the columns, "
            "so the positions whose target is left out are not trained on; raise --sampled_softmax above them or "
            "lower --sampled_softmax_tokens") in captured.err


def test_a_sampled_softmax_per_group_of_tokens_trains_the_same_however_the_step_is_split(tmp_path, shards, capsys):
    # Two micro-batches of 2 rows, or one of 4 rows: with a sample per 64 tokens (2 rows of 32) both score every
    # group against the same columns, and train alike; with a sample per micro-batch they do not.
    def run(name, batch_size, accumulation, group):
        flags = ("--sampled_softmax", "48", "--sampled_softmax_tokens", str(group),
                 "--batch_size", str(batch_size), "--grad_accumulation_steps", str(accumulation))
        assert main(tiny_run_args(shards, tmp_path, name, *flags)) == 0
        rows = read_metrics(tmp_path / name)
        return [r["train_loss"] for r in rows if "train_loss" in r], [r["val_loss"] for r in rows if "val_loss" in r]
    split = run("split", 2, 2, 64)
    whole = run("whole", 4, 1, 64)
    assert len(split[0]) == 6 and len(split[1]) >= 2
    for got, want in zip(whole, split):
        assert got == pytest.approx(want, rel=1e-5, abs=1e-6)
    # Micro-batches smaller than a group draw a sample each, and say so.
    assert run("small", 2, 2, 128) == run("per_micro_batch", 2, 2, 0)
    assert ("notice: --sampled_softmax_tokens 128: a micro-batch holds 64 tokens, so each draws its own sample, for "
            "fewer tokens than that") in capsys.readouterr().err
    one_sample = run("one_sample", 4, 1, 0)
    assert one_sample[0][1:] != pytest.approx(split[0][1:], rel=1e-3)


def test_sampled_softmax_flags_explain_themselves(tmp_path, shards, capsys):
    def error(*extra):
        assert main(tiny_run_args(shards, tmp_path, "run", *extra)) == 2
        return capsys.readouterr().err.strip().splitlines()
    assert error("--sampled_softmax", "-1") == [
        "error: --sampled_softmax -1: pass how many columns to score (e.g. 16384), or 0 for the full softmax"]
    assert error("--sampled_softmax", "64", "--sampled_softmax_tokens", "48") == [
        "error: --sampled_softmax_tokens 48 must divide the micro-batch's 64 tokens (--batch_size x "
        "--sequence_length); pick a divisor, or 0 for one sample per micro-batch"]
    assert error("--sampled_softmax_tokens", "-1") == [
        "error: --sampled_softmax_tokens -1: pass how many tokens each sample covers, or 0 for one sample per "
        "micro-batch"]
    assert not (tmp_path / "run").exists()


def test_a_sample_of_the_whole_vocabulary_trains_the_full_softmax_with_a_notice(tmp_path, shards, capsys,
                                                                              monkeypatch):
    seen = []
    forward = GPT.forward

    def recording_forward(self, idx, targets=None, **kwargs):
        seen.append(kwargs.get("sampled_softmax"))
        return forward(self, idx, targets, **kwargs)
    monkeypatch.setattr(GPT, "forward", recording_forward)
    flags = ("--sampled_softmax", "256")  # the tests' vocabulary has 256 tokens
    assert main(tiny_run_args(shards, tmp_path, "run", *flags)) == 0
    assert ("notice: --sampled_softmax 256 covers the whole vocabulary of 256: the full softmax trains instead"
            in capsys.readouterr().err)
    assert seen and not any(seen)
    args = json.loads((tmp_path / "run" / "config.json").read_text())["args"]
    assert args["sampled_softmax"] == 0  # the config says what trained


def test_lr_schedule_is_nocaps():
    args = Namespace(lr_schedule="trapezoid", warmup_iters=4, warmdown_iters=5, num_iterations=20, lr_floor=0.0)
    lrs = [lr_scale(s, args) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert lrs[4:15] == [1.0] * 11
    assert lrs[15:] == pytest.approx([1.0, 0.8, 0.6, 0.4, 0.2])


def test_lr_floor_ends_the_warmdown_above_zero():
    args = Namespace(lr_schedule="trapezoid", warmup_iters=0, warmdown_iters=4, num_iterations=8, lr_floor=0.1)
    assert [lr_scale(s, args) for s in range(8)] == pytest.approx([1, 1, 1, 1, 1, 0.775, 0.55, 0.325])
    assert lr_scale(8, args) == pytest.approx(0.1)  # where the last step would land
