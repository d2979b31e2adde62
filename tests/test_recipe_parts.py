"""Parts the public speedrun records proved on FineWeb, in this project's own code: what each computes."""

import math

import pytest
import torch

from conftest import read_metrics, tiny_run_args, train_flags
from model_variants import TINY, with_overrides
from recipe_parts import bigram_rows, offset_keys
from train_gpt2 import GPT, main, make_optimizer, model_from_checkpoint

BIGRAM = with_overrides(TINY, vocab_size=64, bigram_table=97)


def test_a_bigram_row_is_a_hash_of_the_previous_and_the_current_token_only():
    idx = torch.tensor([[5, 7, 7, 5, 7], [3, 5, 7, 60, 61]])
    rows = bigram_rows(idx, 97)
    assert rows[:, 0].tolist() == [96, 96]  # nothing before a row's first token: the reserved last row
    assert rows[:, 1:].min() >= 0 and rows[:, 1:].max() < 96
    assert rows[0, 1] == rows[0, 4] == rows[1, 2]  # (5, 7) wherever it occurs
    assert rows[0, 1] != rows[0, 3]  # (5, 7) and (7, 5): the order counts
    pairs = torch.cartesian_prod(torch.arange(64), torch.arange(64))  # every pair: (previous, current) in a row
    spread = torch.bincount(bigram_rows(pairs, 97)[:, 1], minlength=96)
    assert (spread > 0).sum() == 96 and spread.max() < 3 * 4096 / 96  # every bucket used, none crowded


def test_the_bigram_table_starts_silent_and_trains_the_rows_its_pairs_read():
    torch.manual_seed(0)
    plain = GPT(with_overrides(BIGRAM, bigram_table=0))
    torch.manual_seed(0)
    model = GPT(BIGRAM)  # made last: every other weight as without it
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(model(idx, idx)[1], plain(idx, idx)[1])  # a table of zeros adds nothing
    optimizer = make_optimizer(model, train_flags("--optimizer", "muon", "--embed_lr", "0.1"), torch.device("cpu"))
    assert any(model.bigram_embed.weight is p for g in optimizer.optimizers[1].param_groups for p in g["params"]
               if g["lr"] == 0.1)  # with the value embeddings, at --embed_lr
    model(idx, idx)[1].backward()
    optimizer.step()
    read = torch.zeros(97, dtype=torch.bool)
    read[bigram_rows(idx, 97).flatten()] = True
    changed = model.bigram_embed.weight.abs().sum(dim=1) > 0
    assert torch.equal(changed, read)  # the rows the batch's pairs read, and no others


def test_a_negative_table_size_is_refused():
    with pytest.raises(ValueError, match="bigram_table=-1 must be >= 0"):
        with_overrides(TINY, bigram_table=-1)


def test_a_run_with_the_parts_trains_them_and_its_checkpoint_holds_them(tmp_path, shards, capsys):
    assert main(tiny_run_args(shards, tmp_path, "bg", "--bigram_table", "97", "--attn_gate", "12",
                              "--key_offset", "true", "--z_loss", "1e-4", "--optimizer", "muon", "--window", "16",
                              "--window_pattern", "LG", "--window_kind", "chunked", "--window_iters", "4")) == 0
    losses = [r["train_loss"] for r in read_metrics(tmp_path / "bg") if "train_loss" in r]
    assert len(losses) == 6 and all(math.isfinite(loss) for loss in losses)
    checkpoint = sorted((tmp_path / "bg").glob("ckpt_*.pt"))[-1]
    model, _ = model_from_checkpoint(str(checkpoint), torch.device("cpu"))
    assert model.config.key_offset and model.config.bigram_table == 97
    assert model.bigram_embed.weight.abs().sum() > 0  # it trained
    assert model.transformer.h[0].attn.gate.weight.abs().sum() > 0


def test_the_attention_gate_starts_at_half_and_lets_each_head_say_nothing():
    from train_gpt2 import CausalSelfAttention, Rotary
    gated_config = with_overrides(TINY, attn_gate=3)  # 4 heads of 16
    torch.manual_seed(0)
    gated, plain = CausalSelfAttention(gated_config, 0), CausalSelfAttention(TINY, 0)
    plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("gate.")})
    x = torch.randn(2, 10, 64)
    x[..., 0] = 1.0  # the channel the gate's weights below read
    cos, sin = Rotary(16, 32)(10)
    torch.testing.assert_close(gated(x, cos, sin)[0], plain(x, cos, sin)[0] / 2)  # sigmoid(0) = 1/2 per head
    with torch.no_grad():
        gated.gate.weight.zero_()
        gated.gate.weight[:, 0] = torch.tensor([60.0, -60.0, -60.0, 60.0])  # heads 0 and 3 open, 1 and 2 shut
        plain.c_proj.weight[:, 16:48] = 0  # the same, by projecting only heads 0 and 3 back into the stream
    torch.testing.assert_close(gated(x, cos, sin)[0], plain(x, cos, sin)[0])
    with pytest.raises(ValueError, match="attn_gate=65 reads more channels than n_embd=64"):
        with_overrides(TINY, attn_gate=65)


def test_z_loss_adds_the_mean_square_of_log_z_to_the_training_objective_only():
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, z_loss=1e-2))
    idx, targets = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    targets[0, :3] = -1  # ignored positions count in neither term
    logits, objective, aux = model(idx, targets)
    kept = targets != -1
    cross_entropy = torch.nn.functional.cross_entropy(logits[kept], targets[kept])
    log_z = torch.logsumexp(logits[kept], dim=-1)
    torch.testing.assert_close(objective, cross_entropy + 1e-2 * log_z.square().mean())
    torch.testing.assert_close(aux["next_token_loss"], cross_entropy)  # logged: the loss itself
    model.eval()
    torch.testing.assert_close(model(idx, targets)[1], cross_entropy)  # evaluation scores the loss alone
    with pytest.raises(ValueError, match="pass fused_kernels False with it"):
        with_overrides(TINY, z_loss=1e-4, fused_kernels=True)


def test_the_key_offset_shows_the_previous_keys_slowest_rotary_dims_in_global_layers_only():
    from train_gpt2 import CausalSelfAttention, Rotary
    k = torch.randn(2, 5, 3, 16)
    shifted = offset_keys(k)
    slow = [*range(4, 8), *range(12, 16)]  # pairs 4..7 of 8 turn slowest: dims 4..7 and their partners 12..15
    fast = [*range(0, 4), *range(8, 12)]
    torch.testing.assert_close(shifted[:, 1:, :, slow], k[:, :-1, :, slow])
    torch.testing.assert_close(shifted[:, :, :, fast], k[:, :, :, fast])
    torch.testing.assert_close(shifted[:, 0], k[:, 0])  # nothing before the first position
    config = with_overrides(TINY, window=4, window_pattern="LG", key_offset=True)
    x, (cos, sin) = torch.randn(2, 10, 64), Rotary(16, 32)(10)
    for layer, changes in ((0, False), (1, True)):  # a local layer, then a global one
        torch.manual_seed(layer)
        offset = CausalSelfAttention(config, layer)
        plain = CausalSelfAttention(with_overrides(config, key_offset=False), layer)
        plain.load_state_dict(offset.state_dict())
        same = torch.allclose(offset(x, cos, sin)[0], plain(x, cos, sin)[0])
        assert same != changes


def test_the_later_targets_fade_in_turn_the_farthest_first():
    from schedule import fading_weights
    for step in range(0, 901, 25):  # the published form for (0.5, 0.25): [1, .5, .25 -> 0], [1, .5 -> 0], [1]
        x = step / 900
        published = [1.0, 0.5, 0.25 * (1 - 3 * x)] if x < 1 / 3 else [1.0, 0.5 * (2 - 3 * x)] if x < 2 / 3 else [1.0]
        assert fading_weights(step, 900, (0.5, 0.25)) == pytest.approx(published + [0.0] * (3 - len(published)))
    assert fading_weights(300, 1200, (0.4,)) == pytest.approx((1.0, 0.2))  # one target: fades over the first half
    assert fading_weights(700, 1200, (0.4,)) == (1.0, 0.0) and fading_weights(7, 100, ()) == ()


@pytest.mark.parametrize("fused", [False, True])
def test_the_later_targets_are_scored_by_the_next_tokens_logits(fused):
    from train_gpt2 import with_later_targets
    torch.manual_seed(0)
    targets, weights = torch.randint(0, 64, (2, 10)), torch.tensor([1.0, 0.5, 0.25])
    targets[1, 3] = -1  # ignored as the next token, as the token 2 ahead of position 2 and 3 ahead of position 1
    model = GPT(with_overrides(TINY, vocab_size=64, logit_softcap=15.0, fused_kernels=fused))
    h = torch.randn(2, 10, TINY.n_embd, requires_grad=True)
    objective, next_token_loss = model.head_loss(h, with_later_targets(targets, 2), weights=weights)
    logits = model.logits(h).float().reshape(-1, 64)
    by_hand = [torch.nn.functional.cross_entropy(logits[rows], targets[:, j:].reshape(-1), ignore_index=-1)
               for j, rows in enumerate(torch.arange(20).view(2, 10)[:, :10 - j].reshape(-1) for j in range(3))]
    torch.testing.assert_close(objective, by_hand[0] + 0.5 * by_hand[1] + 0.25 * by_hand[2])
    torch.testing.assert_close(next_token_loss, by_hand[0].detach())
    objective.backward()
    assert h.grad[:, -1].abs().sum() > 0 and not next_token_loss.requires_grad
    assert with_later_targets(targets, 2)[0, 8].tolist() == [targets[0, 8], targets[0, 9], -1]


def test_a_run_with_later_targets_trains_on_them_and_logs_the_next_token_loss(shards, tmp_path, capsys):
    from schedule import Schedule
    flags = train_flags("--later_targets", "0.5,0.25", "--num_iterations", "9")
    assert Schedule.of(flags, 0).at(0).target_weights == (1.0, 0.5, 0.25)
    assert Schedule.of(flags, 0).at(6).target_weights == (1.0, 0.0, 0.0)
    assert main(tiny_run_args(shards, tmp_path, "later", "--later_targets", "0.5,0.25")) == 0
    assert main(tiny_run_args(shards, tmp_path, "plain")) == 0
    later, plain = ([r for r in read_metrics(tmp_path / name) if "train_loss" in r] for name in ("later", "plain"))
    assert later[0]["train_loss"] == pytest.approx(plain[0]["train_loss"])  # the same first step's next-token loss
    assert later[-1]["train_loss"] != plain[-1]["train_loss"]  # trained on other targets
    capsys.readouterr()
    for bad, why in (("0.5,x", "pass weights separated by commas"), ("-1", "each weight must be a finite number")):
        with pytest.raises(SystemExit) as stop:
            main(tiny_run_args(shards, tmp_path, "bad", "--later_targets", bad))
        assert stop.value.code == 2 and f"argument --later_targets: '{bad}': {why}" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists()


def test_an_embedding_to_untie_is_the_tied_one_until_it_unties_then_trains_apart():
    from train_gpt2 import Optimizers
    idx = torch.randint(0, TINY.vocab_size, (2, 16))
    losses, grads = [], []
    for untie_at in (0.0, 0.5):  # the same draws: the separate table is made, then left unused, until the untie
        torch.manual_seed(0)
        model = GPT(with_overrides(TINY, untie_at=untie_at))
        loss = model(idx, idx.roll(-1, 1))[1]
        loss.backward()
        losses.append(loss.detach())
        grads.append(model.lm_head.weight.grad)
    assert torch.equal(losses[0], losses[1]) and torch.equal(grads[0], grads[1])
    assert model.transformer.wte.weight.grad is None and model.num_params() > GPT(TINY).num_params()
    optimizer = Optimizers([torch.optim.AdamW(model.parameters(), lr=1e-2)])
    optimizer.step()  # the head's moments exist, the embedding's not yet
    model.untie()
    optimizer.copy_state(model.lm_head.weight, model.transformer.wte.weight)
    head_state, embed_state = (optimizer.optimizers[0].state[p] for p in (model.lm_head.weight,
                                                                         model.transformer.wte.weight))
    assert torch.equal(head_state["exp_avg"], embed_state["exp_avg"])
    assert head_state["exp_avg"].data_ptr() != embed_state["exp_avg"].data_ptr()  # copies, apart from here
    assert torch.equal(model.transformer.wte.weight, model.lm_head.weight) and model.untied
    model.zero_grad()
    model(idx, idx.roll(-1, 1))[1].backward()
    optimizer.step()
    assert not torch.equal(model.transformer.wte.weight, model.lm_head.weight)  # each from its own gradient


def test_a_checkpoint_after_the_untie_loads_with_the_embeddings_own_copy(shards, tmp_path):
    assert main(tiny_run_args(shards, tmp_path, "untie", "--untie_at", "0.5", "--save_every", "3")) == 0
    model, _ = model_from_checkpoint(str(tmp_path / "untie" / "ckpt_000006.pt"), torch.device("cpu"))
    assert model.untied and not torch.equal(model.transformer.wte.weight, model.lm_head.weight)
    idx = torch.randint(0, 64, (1, 32))
    tied_reading = model.eval()(idx, idx)[1]
    model.untied = False
    assert tied_reading != model(idx, idx)[1]  # the embedding's own copy is what the run ended with


def test_the_later_targets_of_a_grouped_sample_are_scored_group_by_group():
    from train_gpt2 import SoftmaxSample, with_later_targets
    torch.manual_seed(1)
    targets, weights, draws = torch.randint(0, 40, (4, 8)), torch.tensor([1.0, 0.3]), torch.rand(2, 64)
    scored = with_later_targets(targets, 1)  # (4, 8, 2): rows 0-1 one group, rows 2-3 the other
    model = GPT(with_overrides(TINY, vocab_size=64, fused_kernels=True))
    h = torch.randn(4, 8, TINY.n_embd)
    objective, loss = model.head_loss(h, scored, sample=SoftmaxSample(40, draws, torch.zeros(64)), weights=weights)
    halves = [model.head_loss(h[rows], scored[rows], sample=SoftmaxSample(40, draws[k], torch.zeros(64)),
                              weights=weights) for k, rows in enumerate((slice(0, 2), slice(2, 4)))]
    torch.testing.assert_close(objective, (halves[0][0] + halves[1][0]) / 2)
    torch.testing.assert_close(loss, (halves[0][1] + halves[1][1]) / 2)
    assert objective > loss  # the later target's term on top of the next token's
