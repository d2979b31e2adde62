"""The command line: flags, --model's recipes and their re-sizing, --help, --list_models; and bad input, which is one
`error:` line naming the flag or file and its fix, exit code 2, nothing overwritten."""

import shutil

import pytest

from conftest import checked_flags, error_line, make_shards, tiny_run_args, train_flags
from train_gpt2 import build_parser, main


def test_unknown_model_suggests_close_names(tmp_path, shards, capsys):
    argv = tiny_run_args(shards, tmp_path)
    argv[argv.index("tiny")] = "d21"
    line = error_line(capsys, argv)
    assert "unknown model 'd21'; did you mean" in line and "d12" in line


@pytest.mark.parametrize("extra, message", [
    (["--n_head", "3"], "n_head=3 does not divide n_embd=64"),
    (["--input_bin", "/nonexistent/x_*.bin"], "--input_bin: no files match"),
    (["--input_val_bin", "/nonexistent/v_*.bin"], "--input_val_bin: no files match"),
    (["--val_tokens", "100032"], "fewer than --val_tokens"),
    (["--total_batch_size", "100"], "not a multiple of batch_size*sequence_length"),
    (["--total_batch_size", "128", "--grad_accumulation_steps", "4"], "contradicts --total_batch_size"),
    (["--warmdown_iters", "99"], "exceed --num_iterations 6"),
    (["--warmup_iters", "5", "--warmdown_iters", "2"], "--warmup_iters 5 + --warmdown_iters 2 exceed"),
    (["--learning_rate", "-1"], "--learning_rate -1.0 must be a finite number >= 0"),
    (["--weight_decay", "-1"], "--weight_decay -1.0 must be a finite number >= 0"),
    (["--optimizer", "muon", "--muon_lr", "-0.02"], "--muon_lr -0.02 must be a finite number >= 0"),
    (["--normuon_beta2", "1"], "--normuon_beta2 1.0 must be in [0, 1) (e.g. 0.95; 0: off)"),
    (["--optimizer", "soap", "--soap_max_dim", "0"], "--soap_max_dim 0 must be >= 1"),
    (["--optimizer", "soap", "--soap_block", "-1"], "--soap_block -1 must be >= 0"),
    (["--optimizer", "muon", "--cautious_weight_decay", "-1"],
     "--cautious_weight_decay -1.0 must be a finite number >= 0"),
    (["--sequence_length", "2048"], "pass --block_size 2048"),
    (["--resume", "/nonexistent.pt"], "no such checkpoint"),
    (["--memory_cap_gib", "22"], "--memory_cap_gib limits GPU memory; drop it on CPU"),
    (["--overtime_steps", "5", "--target_val_loss", "3"], "which is 0; pass --lr_floor > 0"),
    (["--overtime_steps", "5", "--target_val_loss", "3", "--lr_floor", "0.1", "--val_loss_every", "0"],
     "pass --val_loss_every > 0"),
    (["--overtime_steps", "-1"], "--overtime_steps -1 must be >= 0"),
    (["--curriculum_iters", "9"], "--curriculum_iters 9: pass the step (1 to --num_iterations 6)"),
    (["--lr_schedule", "one_cycle", "--warmup_iters", "0"], "--lr_schedule one_cycle rises over --warmup_iters"),
    (["--layerdrop", "1.0"], "--layerdrop 1.0 is a probability"),
    (["--val_sequence_length", "2048"], "--val_sequence_length 2048 exceeds the model's block_size"),
    (["--val_sequence_length", "1536", "--block_size", "2048"],
     "--val_sequence_length 1536: rows longer than NoCap's 1024 must be a multiple of it"),
    (["--target_val_loss", "-1"], "--target_val_loss -1.0 must be a finite loss >= 0 (0: no target"),
    (["--target_val_loss", "nan"], "--target_val_loss nan must be a finite loss >= 0"),
    (["--run_name", "r" * 300], "--run_name is 300 bytes long; a directory name holds at most 255"),
])
def test_bad_flags_give_one_clear_line(tmp_path, shards, capsys, extra, message):
    assert message in error_line(capsys, tiny_run_args(shards, tmp_path, "run", *extra))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_an_empty_or_compressed_shard_is_named_with_its_fix(tmp_path, capsys):
    import lzma
    import numpy as np
    from data.shards import write_shard
    shards = make_shards(tmp_path / "d")
    write_shard(str(tmp_path / "d" / "syn_train_000003.bin"), np.zeros(0, dtype=np.uint16))
    assert error_line(capsys, tiny_run_args(shards, tmp_path)) == (
        f"error: {tmp_path / 'd' / 'syn_train_000003.bin'}: holds no tokens; leave it out of --input_bin, or make it "
        "again (python data/fineweb.py)")
    packed = tmp_path / "d" / "syn_train_000003.bin"
    packed.write_bytes(lzma.compress((tmp_path / "d" / "syn_train_000001.bin").read_bytes()))
    assert error_line(capsys, tiny_run_args(shards, tmp_path)) == (
        f"error: {packed}: a xz-compressed file, not a token shard; decompress it first (xz -dk {packed}; a folder "
        "of .bin.xz: python scripts/proxy.py stage)")


def test_out_of_vocab_shard_is_reported(tmp_path, capsys):
    bad = make_shards(tmp_path / "d", vocab=300)
    argv = tiny_run_args(bad, tmp_path)
    assert "is >= vocab_size 256" in error_line(capsys, argv)


def test_a_bad_token_in_a_later_shard_stops_the_run_before_step_0(tmp_path, capsys):
    import numpy as np
    from data.shards import write_shard
    shards = make_shards(tmp_path / "d", n_train=3)
    tokens = np.random.default_rng(0).integers(0, 256, 20_000)
    tokens[12_345] = 300
    write_shard(str(tmp_path / "d" / "syn_train_000003.bin"), tokens)
    line = error_line(capsys, tiny_run_args(shards, tmp_path))
    assert line == (f"error: {tmp_path / 'd' / 'syn_train_000003.bin'}: token id 300 at position 12,345 is >= "
                    "vocab_size 256 — shard made with another tokenizer, or the wrong --vocab_size")
    assert not (tmp_path / "run").exists()  # nothing trained, nothing written


def test_finished_and_started_run_dirs_are_not_overwritten(tmp_path, shards, capsys):
    assert main(tiny_run_args(shards, tmp_path)) == 0
    capsys.readouterr()
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    assert "already holds a finished run" in error_line(capsys, tiny_run_args(shards, tmp_path))
    (tmp_path / "run" / "summary.json").unlink()
    assert "pass --resume auto" in error_line(capsys, tiny_run_args(shards, tmp_path))
    after = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir()}
    assert {k: v for k, v in before.items() if k != "summary.json"} == after


def test_resume_refuses_a_checkpoint_of_another_model(tmp_path, shards, capsys):
    assert main(tiny_run_args(shards, tmp_path, "a")) == 0
    ckpt = next((tmp_path / "a").glob("ckpt_*.pt"))
    shutil.copy(ckpt, tmp_path / "elsewhere.pt")
    capsys.readouterr()
    line = error_line(capsys, tiny_run_args(shards, tmp_path, "b", "--n_layer", "3", "--resume",
                                        str(tmp_path / "elsewhere.pt")))
    assert f"{tmp_path / 'elsewhere.pt'} was trained with another model_config (n_layer 2 there, 3 here);" in line
    assert "start a new run" in line and len(line) < 300


def test_resume_refuses_a_file_that_is_not_a_checkpoint(tmp_path, shards, capsys):
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    line = error_line(capsys, tiny_run_args(shards, tmp_path, "b", "--resume", str(tmp_path / "junk.pt")))
    assert "not a readable checkpoint" in line


def test_resume_auto_needs_a_run_name(tmp_path, shards, capsys):
    argv = tiny_run_args(shards, tmp_path)
    del argv[argv.index("--run_name"): argv.index("--run_name") + 2]
    assert "--resume auto needs --run_name" in error_line(capsys, argv + ["--resume", "auto"])


def test_nocap_run_sh_flags_parse_unchanged():
    args = train_flags(*(
        "--input_bin a --input_val_bin b --output_dir pylog124M --model d12 --batch_size 16 "
        "--grad_accumulation_steps 32 --sequence_length 1024 --val_loss_every 128 --val_batch_size 16 "
        "--num_iterations 4768 --weight_decay 0.1 --learning_rate 0.0018 --warmup_iters 256 "
        "--warmdown_iters 1024 --log_wandb".split()))
    assert (args.batch_size, args.grad_accumulation_steps, args.learning_rate, args.log_wandb) == (16, 32, 0.0018, True)


def test_a_bad_flag_value_is_one_line_and_where_to_look(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["--batch_size", "2.5"])
    err = capsys.readouterr().err
    assert stop.value.code == 2 and len(err.splitlines()) == 1
    assert err.startswith("error: argument --batch_size: invalid int value: '2.5' (")
    assert "--help lists the flags)" in err
    for every in ("soon", "-5m"):
        with pytest.raises(SystemExit):
            main([f"--save_every={every}"])
        assert capsys.readouterr().err.startswith(
            f"error: argument --save_every: expected steps (500) or minutes (30m), got '{every}'")


def test_help_gives_each_model_flag_its_meaning_and_the_chosen_variants_values(capsys):
    from model_variants import config_fields
    with pytest.raises(SystemExit):
        train_flags("--model", "d12_fast", "--help")
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    assert "--n_head N_HEAD attention heads (head_dim = n_embd / n_head) (d12_fast: 6)" in text
    assert "--mlp_act MLP_ACT the MLP's activation: gelu, relu2 (ReLU squared) or swiglu (d12_fast: 'relu2')" in text
    assert "optimizer steps at most (default: 1667)" in text  # the recipe's, not NoCap's 4768
    assert "override the variant" not in text and "(default: None)" not in text
    assert all(f.metadata.get("help") for f in config_fields())
    with pytest.raises(SystemExit):
        train_flags("--help")
    text = " ".join(capsys.readouterr().out.split())
    assert "(d12: 12)" in text and "optimizer steps at most (default: 4768)" in text


def test_num_iterations_alone_resizes_the_recipes_step_counted_settings(capsys):
    fast = train_flags("--model", "d12_fast", "--num_iterations", "500")  # 30% of the recipe's 1,667
    assert (fast.warmdown_iters, fast.muon_momentum_warmup, fast.window_iters, fast.val_loss_every) == (
        500, 75, 328, "auto")  # evaluations planned from the curve already scale with the run
    assert fast.overtime_steps == 250
    assert ("notice: --num_iterations 500 re-sizes d12_fast's schedule of 1667 steps: --warmdown_iters 500 "
            "--muon_momentum_warmup 75") in capsys.readouterr().err
    mine = train_flags("--model", "d12_fast", "--num_iterations=500", "--window_iter", "100")  # abbreviated
    assert (mine.window_iters, mine.warmdown_iters) == (100, 500)  # a flag given wins
    d12 = train_flags("--num_iterations", "1000")  # NoCap's 256 and 1024 of 4768 steps, and 128 between evaluations
    assert (d12.warmup_iters, d12.warmdown_iters, d12.val_loss_every) == (54, 215, 27)
    capsys.readouterr()
    same = train_flags("--model", "d12_fast", "--num_iterations", "1667")
    assert (same.warmdown_iters, same.window_iters) == (1667, 1094) and capsys.readouterr().err == ""
    checked_flags("--model", "d12_fast", "--num_iterations", "500")  # the recipe at 30% of its length is valid


def test_a_batch_other_than_the_recipes_keeps_its_tokens_and_its_schedules_shape(capsys):
    fast = train_flags("--model", "d12_fast", "--total_batch_size", "65536")  # a sixth of the recipe's 393,216
    assert (fast.num_iterations, fast.warmdown_iters, fast.muon_momentum_warmup, fast.window_iters) == (
        10002, 10002, 1500, 6564)
    assert ("notice: --total_batch_size 65536 (the recipe's 393216: the same tokens in 10002 steps) re-sizes "
            "d12_fast's schedule of 1667 steps: --warmdown_iters 10002") in capsys.readouterr().err
    nocap = train_flags("--model", "d12_nocap", "--total_batch_size", "32768")  # 2.5B tokens either way
    assert (nocap.num_iterations, nocap.warmup_iters, nocap.curriculum_iters, nocap.overtime_steps) == (
        76288, 1526, 6104, 19072)
    longer = train_flags("--model", "d12_fast", "--total_batch_size", "65536", "--num_iterations", "500")
    assert (longer.num_iterations, longer.window_iters) == (500, 328)  # steps given: the run's fractions
    capsys.readouterr()
    same = train_flags("--model", "d12_fast", "--total_batch_size", "393216")
    d12 = train_flags("--total_batch_size", "131072")  # NoCap's schedule names no batch of its own
    assert (same.num_iterations, d12.num_iterations) == (1667, 4768) and capsys.readouterr().err == ""


def test_every_model_field_has_an_override_flag():
    from model_variants import config_fields
    args = build_parser().parse_args(["--n_layer", "6", "--logit_softcap", "15", "--attn_impl", "manual"])
    assert (args.n_layer, args.logit_softcap, args.attn_impl) == (6, 15.0, "manual")
    assert all(hasattr(args, f.name) for f in config_fields())


def test_a_variants_recipe_sets_flag_defaults_and_explicit_flags_win():
    d12, fast = train_flags(), train_flags("--model", "d12_fast")
    assert (d12.optimizer, d12.learning_rate, d12.total_batch_size) == ("adamw", 0.0018, None)
    assert (fast.optimizer, fast.total_batch_size, fast.batch_size, fast.lr_floor) == ("muon", 393216, 8, 0.1)
    assert (fast.sequence_length, fast.val_row_length, fast.val_batch_size) == (4096, 4096, 16)
    shorter = train_flags("--model", "d12_fast", "--sequence_length", "1024", "--batch_size", "32")
    assert shorter.val_row_length == 1024  # validated on the rows it trains on
    assert (fast.warmdown_iters, fast.num_iterations, fast.normuon_beta2, fast.cautious_weight_decay) == (
        1667, 1667, 0.95, 1.2)
    assert (fast.sampled_softmax, d12.sampled_softmax, fast.embed_lr, d12.embed_lr) == (16384, 0, 0.6, None)
    assert d12.normuon_beta2 == 0.0
    assert train_flags("--model", "d12_fast", "--batch_size", "16").batch_size == 16
    assert (d12.compile_tuning, fast.compile_tuning) == ("coordinate_descent", "combo_kernels")
    assert train_flags("--model=d12_fast", "--compile_tuning", "none").compile_tuning == "none"
    mine = train_flags("--model=d12_fast", "--optimizer", "adamw", "--lr_floor", "0")
    assert (mine.optimizer, mine.lr_floor, mine.muon_lr) == ("adamw", 0.0, fast.muon_lr)
    # Either batch flag replaces the recipe's batch size, so the two can never contradict each other.
    for flag in ("--grad_accumulation_steps", "--total_batch_size"):
        args = train_flags("--model", "d12_fast", flag, "16384")
        assert args.total_batch_size == (16384 if flag == "--total_batch_size" else None)


def test_list_models(capsys):
    from model_variants import VARIANTS
    with pytest.raises(SystemExit) as stop:
        main(["--list_models"])
    assert stop.value.code == 0
    lines = capsys.readouterr().out.splitlines()[1:]
    rows = {line.split()[0]: line for line in lines if not line.startswith("--model")}
    assert rows.keys() == VARIANTS.keys()
    recipes = {line.split()[1]: line for line in lines if line.startswith("--model")}
    assert recipes["d12_fast"].startswith("--model d12_fast also sets: --optimizer muon")
    assert recipes["d12_fast"].endswith(" --compile_tuning combo_kernels")  # as the flags are typed
    assert recipes["d12_nocap"] == ("--model d12_nocap also sets: --optimizer soap --soap_lr 0.003 "
                                    "--soap_block 768 --learning_rate 0.0008 --total_batch_size 65536 "
                                    "--num_iterations 38144 --lr_schedule target --warmup_iters 763 "
                                    "--warmdown_iters 38144 --lr_floor 0.1 --overtime_steps 9536 --cooldown_drop 0.3 "
                                    "--curriculum_iters 3052 --val_loss_every auto")
    assert rows["d12"].split()[5:7] == ["123.5M", "123.5M"]  # 50257*768 + 12*12*768^2, all active
    assert rows["d12_moe"].split()[5:7] == ["293.5M", "123.6M"] and "moe_experts=8" in rows["d12_moe"]
    assert rows["d12_gqa"].split()[3] == "4" and rows["d12_gqa"].endswith("n_kv_head=4")
