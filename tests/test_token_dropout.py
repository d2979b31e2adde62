"""Token dropout with a consistency loss (--token_dropout, R-Drop over a clean and a token-dropped pass): the
symmetric KL, the objective, where dropped tokens read, the masks' draw, a run's logs and its FLOPs count."""

import math
from argparse import Namespace

import torch
import torch.nn.functional as F

from conftest import read_metrics, tiny_run_args
from model_variants import TINY, with_overrides
from plan_ideas import CONSISTENCY_WEIGHT, symmetric_kl, tokens_to_keep
from train_gpt2 import GPT, StepMeter, flops_per_token, main, micro_batch_seed


def test_symmetric_kl_is_the_mean_of_both_kl_divergences():
    torch.manual_seed(0)
    a, b = torch.randn(3, 5, 11, dtype=torch.float64), torch.randn(3, 5, 11, dtype=torch.float64)
    log_a, log_b = a.log_softmax(-1), b.log_softmax(-1)
    both = F.kl_div(log_b, log_a, log_target=True, reduction="none") + F.kl_div(
        log_a, log_b, log_target=True, reduction="none")  # KL(a || b) + KL(b || a), per entry
    torch.testing.assert_close(symmetric_kl(a, b), both.sum(-1).mean() / 2)
    assert symmetric_kl(a, a) == 0


def test_the_objective_is_r_drop_over_a_clean_pass_and_one_with_dropped_tokens_read_as_end_of_text():
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, x0_mix=True, fused_kernels=True)).double()
    idx, targets = torch.randint(0, 63, (2, 12)), torch.randint(0, 64, (2, 12))
    keep = torch.rand(2, 12) > 0.3
    keep[0, :2] = False  # a row that starts with dropped tokens
    objective, aux = model(idx, targets, token_keep=keep)[1:]
    clean_logits = model(idx, targets)[0]
    masked_logits = model(idx.masked_fill(~keep, 63), targets)[0]  # 63: this vocabulary's <|endoftext|>
    clean, masked = F.cross_entropy(clean_logits.flatten(0, 1), targets.flatten()), F.cross_entropy(
        masked_logits.flatten(0, 1), targets.flatten())
    consistency = symmetric_kl(clean_logits, masked_logits)
    torch.testing.assert_close(objective, (clean + masked) / 2 + CONSISTENCY_WEIGHT * consistency)
    torch.testing.assert_close(aux["next_token_loss"], clean)
    torch.testing.assert_close(aux["masked_token_loss"], masked)
    torch.testing.assert_close(aux["consistency_loss"], consistency)
    assert consistency > 0 and not torch.isclose(clean, masked)
    everything = torch.ones(2, 12, dtype=torch.bool)  # nothing dropped: both passes agree, the plain objective
    torch.testing.assert_close(model(idx, targets, token_keep=everything)[1], model(idx, targets)[1])


def test_the_masks_drop_the_asked_fraction_and_repeat_for_a_resumed_run():
    cpu, shape = torch.device("cpu"), torch.Size((16, 1024))
    keep = tokens_to_keep(micro_batch_seed(0, 3, 1), 0.15, shape, cpu)
    assert keep.dtype == torch.bool and abs(1 - keep.float().mean() - 0.15) < 0.01
    assert torch.equal(keep, tokens_to_keep(micro_batch_seed(0, 3, 1), 0.15, shape, cpu))
    assert not torch.equal(keep, tokens_to_keep(micro_batch_seed(0, 4, 1), 0.15, shape, cpu))
    assert tokens_to_keep(micro_batch_seed(0, 3, 1), 0.0, shape, cpu) is None


def test_a_token_dropout_run_logs_both_passes_and_counts_their_work(tmp_path, shards, capsys):
    assert main(tiny_run_args(shards, tmp_path, "td", "--token_dropout", "0.15")) == 0
    steps = [r for r in read_metrics(tmp_path / "td") if "train_loss" in r]
    assert all(r["consistency_loss"] > 0 and r["masked_token_loss"] > 0 for r in steps)
    assert all(math.isfinite(r["train_loss"]) and r["train_loss"] != r["masked_token_loss"] for r in steps)
    meter = StepMeter(GPT(TINY), Namespace(device=torch.device("cpu"), world_size=1), 100, passes=2)
    assert meter.flops_token(32, 0) == 2 * flops_per_token(GPT(TINY), 32)
    capsys.readouterr()
    assert main(tiny_run_args(shards, tmp_path, "ss", "--token_dropout", "0.15", "--sampled_softmax", "32")) == 2
    expected = ("error: --token_dropout compares both passes' full next-token softmaxes; pass --sampled_softmax 0 "
                "and no --later_targets")
    assert capsys.readouterr().err.strip() == expected
    assert main(tiny_run_args(shards, tmp_path, "lt", "--token_dropout", "0.15", "--later_targets", "0.5")) == 2
    assert capsys.readouterr().err.strip() == expected
    assert main(tiny_run_args(shards, tmp_path, "p1", "--token_dropout", "1")) == 2
