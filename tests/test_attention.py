"""The attention seam: grouped heads equal MHA, every backend equals the manual definition (windows, chunks,
GQA), local layers see only their window, the chunked layers' kernel trains as SDPA does, fallbacks say so once,
and MLA and QK-norm do what they claim."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kernels
from model_variants import D12, TINY, with_overrides
from train_gpt2 import GPT, causal_attention, causal_mask, compute_dtype

from conftest import REPO, next_token_logit_grads, shrink

# FlexAttention runs unfused on CPU and says so; that is expected here.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def test_grouped_query_heads_equal_mha_with_repeated_kv_weights():
    """GQA: query head h reads key/value head h // (n_head / n_kv_head). An MHA model whose K/V
    projections repeat each shared head's rows that way computes the same function."""
    torch.manual_seed(0)
    gqa = GPT(with_overrides(TINY, vocab_size=64, n_kv_head=2)).double()
    mha = GPT(with_overrides(TINY, vocab_size=64)).double()
    state = gqa.state_dict()
    d, hd = 64, 16
    for layer in range(2):
        w = state[f"transformer.h.{layer}.attn.c_attn.weight"]  # (d + 2 * 2 * hd, d)
        q, k, v = w.split((d, 2 * hd, 2 * hd))
        def repeat(m):
            return m.view(2, hd, d).repeat_interleave(2, dim=0).reshape(4 * hd, d)
        state[f"transformer.h.{layer}.attn.c_attn.weight"] = torch.cat([q, repeat(k), repeat(v)])
    mha.load_state_dict(state)
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(gqa.eval()(idx, idx)[1], mha.eval()(idx, idx)[1])


def test_gqa_with_n_kv_head_equal_to_n_head_is_mha():
    torch.manual_seed(0)
    mha = GPT(with_overrides(TINY, vocab_size=64))
    same = GPT(with_overrides(TINY, vocab_size=64, n_kv_head=4))
    same.load_state_dict(mha.state_dict())
    idx = torch.randint(0, 64, (2, 16))
    torch.testing.assert_close(mha.eval()(idx, idx)[1], same.eval()(idx, idx)[1], rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["sdpa", "flash", "flex"])
@pytest.mark.parametrize("window, kv_heads, chunked", [(0, 4, False), (0, 2, False), (5, 4, False), (5, 1, False),
                                                       (8, 4, True), (5, 2, True)])  # 32 = 4 blocks of 8; 5 pads
def test_attention_backends_equal_manual(impl, window, kv_heads, chunked):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 32, 16)
    k, v = torch.randn(2, kv_heads, 32, 16), torch.randn(2, kv_heads, 32, 16)
    got = causal_attention(q, k, v, impl, window, chunked=chunked)  # flex builds its block mask when none is passed
    expected = causal_attention(q, k, v, "manual", window, chunked=chunked)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    if chunked:  # and differs from the sliding window of the same length
        assert not torch.allclose(expected, causal_attention(q, k, v, "manual", window))


@pytest.mark.parametrize("impl", ["sdpa", "flex"])
@pytest.mark.parametrize("kind", ["sliding", "chunked"])
def test_hybrid_local_global_model_equals_manual(impl, kind):
    torch.manual_seed(0)
    config = with_overrides(TINY, vocab_size=64, n_layer=4, window=6, window_pattern="LLLG", attn_impl=impl,
                            window_kind=kind)
    assert [config.layer_window(i) for i in range(4)] == [6, 6, 6, 0]
    model, manual = GPT(config), GPT(with_overrides(config, attn_impl="manual"))
    manual.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, 20))
    with torch.no_grad():  # on CPU FlexAttention runs only without autograd; this exercises its real path
        torch.testing.assert_close(model(idx, idx)[1], manual(idx, idx)[1], rtol=1e-5, atol=1e-5)
    # The global layer really is global: the all-local model with the same weights differs.
    all_local = GPT(with_overrides(config, window_pattern="L"))
    all_local.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert not torch.allclose(model(idx, idx)[1], all_local(idx, idx)[1])


def test_window_restricts_attention_to_recent_tokens():
    mask = causal_mask(6, 3, "cpu")
    assert mask[5].tolist() == [False, False, False, True, True, True]
    assert mask[1].tolist() == [True, True, False, False, False, False]


def test_chunked_window_restricts_attention_to_the_querys_aligned_block():
    mask = causal_mask(6, 3, "cpu", chunked=True)
    assert mask[5].tolist() == [False, False, False, True, True, True]
    assert mask[3].tolist() == [False, False, False, True, False, False]  # a block's first query sees itself only
    assert mask[2].tolist() == [True, True, True, False, False, False]


@pytest.mark.parametrize("T", [24, 21])  # whole blocks of 6, and a last block cut short
def test_chunked_local_layers_train_through_sdpa_and_match_manual(T):
    # The SDPA path (blocks as a batch) against the manual path's mask, with gradients: the recipe trains
    # through it. Blocks stay independent: a local layer's output at a block's first position ignores the
    # positions before it, which the LLLG model's global layer then sees.
    torch.manual_seed(0)
    config = with_overrides(TINY, vocab_size=64, n_layer=4, window=6, window_pattern="LLLG", window_kind="chunked")
    model, manual = GPT(config), GPT(with_overrides(config, attn_impl="manual"))
    manual.load_state_dict(model.state_dict())
    idx = torch.randint(0, 64, (2, T))
    loss, manual_loss = model(idx, idx)[1], manual(idx, idx)[1]
    torch.testing.assert_close(loss, manual_loss, rtol=1e-5, atol=1e-5)
    loss.backward()
    manual_loss.backward()
    for (name, p), q in zip(model.named_parameters(), manual.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=name)
    all_local = GPT(with_overrides(config, window_pattern="L")).eval()
    all_local.load_state_dict(model.state_dict())
    assert next_token_logit_grads(all_local, idx, 6)[0, :6].abs().sum() == 0
    assert next_token_logit_grads(all_local, idx, 5)[0, :6].abs().sum() > 0
    assert next_token_logit_grads(model.eval(), idx, 6)[0, :6].abs().sum() > 0


CHUNKED_FIELDS = dict(vocab_size=64, n_layer=4, window=32, window_pattern="LLLG", window_kind="chunked",
                      block_size=64)
CHUNKED = with_overrides(TINY, **CHUNKED_FIELDS)


@pytest.mark.skipif(kernels.triton is None, reason="Triton is not installed (pip install triton: requirements.txt "
                                                    "has it on Linux)")
def test_chunked_attention_kernel_trains_as_sdpa_does_and_compiles_whole(tmp_path):
    # Under Triton's interpreter the CPU runs the kernel: in bf16 autocast a model's local layers (three of four)
    # call it, and its loss and gradients are SDPA's up to bf16 rounding. Compiled, the kernel's custom ops stay
    # whole: one graph, equal to eager.
    child = textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {str(REPO)!r})
        import kernels
        from model_variants import TINY, with_overrides
        from train_gpt2 import GPT, causal_attention
        CHUNKED = with_overrides(TINY, **{CHUNKED_FIELDS!r})
        calls = []
        kernel = kernels.block_attention
        kernels.block_attention = lambda *args: calls.append(args[0].dtype) or kernel(*args)
        runs = {{}}
        for flag in (False, True):
            torch.manual_seed(0)
            model = GPT(with_overrides(CHUNKED, fused_kernels=flag))
            idx = torch.randint(0, 64, (2, 64), generator=torch.Generator().manual_seed(1))
            with torch.autocast("cpu", torch.bfloat16):
                loss = model(idx, idx)[1]
            loss.backward()
            runs[flag] = (loss.detach(), [p.grad for p in model.parameters()])
        model_calls = list(calls)
        attend = lambda q, k, v: causal_attention(q, k, v, "sdpa", 32, chunked=True, chunked_kernel=True)
        q, k, v = (torch.randn(2, 64, 4, 16, dtype=torch.bfloat16).transpose(1, 2) for _ in range(3))
        explained = torch._dynamo.explain(attend)(q, k, v)
        compiled = torch.compile(attend)(q, k, v)
        torch.save(dict(runs=runs, model_calls=model_calls, graphs=explained.graph_count,
                        breaks=explained.graph_break_count, compiled=compiled, eager=attend(q, k, v)),
                   {str(tmp_path / "out.pt")!r})
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run([sys.executable, "-c", child], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    out = torch.load(tmp_path / "out.pt")
    assert out["model_calls"] == [torch.bfloat16] * 3  # the local layers, in autocast's dtype; not the global one
    (sdpa_loss, sdpa_grads), (kernel_loss, kernel_grads) = out["runs"][False], out["runs"][True]
    torch.testing.assert_close(kernel_loss, sdpa_loss, rtol=1e-2, atol=0)
    for kernel_grad, sdpa_grad in zip(kernel_grads, sdpa_grads):
        if sdpa_grad.norm() > 0:
            assert (kernel_grad - sdpa_grad).norm() / sdpa_grad.norm() < 0.02  # bf16's rounding: ~0.01
    assert (out["graphs"], out["breaks"]) == (1, 0)
    torch.testing.assert_close(out["compiled"], out["eager"], rtol=0, atol=0)


def test_chunked_attention_kernel_falls_back_to_sdpa_where_it_cannot_run(monkeypatch):
    # Without Triton's interpreter the CPU is no Triton device: the flag changes nothing, bit for bit.
    monkeypatch.setattr(kernels, "INTERPRETING", False)
    monkeypatch.setattr(kernels, "block_attention", lambda *args: pytest.fail("the kernel ran"))
    torch.manual_seed(0)
    plain = GPT(CHUNKED)
    flagged = GPT(with_overrides(CHUNKED, fused_kernels=True))
    flagged.load_state_dict(plain.state_dict())
    idx = torch.randint(0, 64, (2, 64))
    torch.testing.assert_close(flagged(idx, idx)[1], plain(idx, idx)[1], rtol=0, atol=0)


def test_sdpa_with_a_window_falls_back_with_one_notice(capsys):
    q = torch.randn(1, 2, 8, 4)
    for _ in range(3):
        causal_attention(q, q, q, "sdpa", window=3)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("notice: attn_impl=sdpa has no sliding-window kernel")


def test_a_notice_inside_a_compiled_forward_neither_splits_it_nor_goes_missing(capsys):
    # Fallback notices are printed inside the model. Traced as a print, one split d12_flash's compiled
    # step (61.7 instead of ~35 ms per step on an H100); now it runs while dynamo traces, outside the graph.
    q = torch.randn(1, 2, 8, 4)
    explanation = torch._dynamo.explain(lambda t: causal_attention(t, t, t, "sdpa", window=3) * 2)(q)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("notice: attn_impl=sdpa has no sliding-window kernel")


def test_compute_dtype_is_autocasts_dtype_where_autocast_is_on():
    # bf16 q times the fp32 rotary tables is an fp32 q, which SDPA under autocast still computes in bf16:
    # the flash backend's fp32 fallback looked at q.dtype and so never forced flash in bf16 training.
    x = torch.ones(2, dtype=torch.bfloat16) * torch.ones(2)
    assert x.dtype == torch.float32 and compute_dtype(x) == torch.float32
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert compute_dtype(x) == torch.bfloat16


def test_mla_compresses_kv_through_the_latent():
    config = shrink(D12, kv_lora_rank=16)
    attn = GPT(config).transformer.h[0].attn
    assert attn.c_kv_down.weight.shape == (16 + 8, 64)  # latent + shared rotary key
    assert attn.c_kv_up.weight.shape == (4 * (8 + 16), 16)  # per head: rotary-free key part + value
    model = GPT(config)
    manual = GPT(with_overrides(config, attn_impl="manual"))
    manual.load_state_dict(model.state_dict())
    idx = torch.randint(0, 128, (2, 20))
    torch.testing.assert_close(model.eval()(idx, idx)[1], manual.eval()(idx, idx)[1])


def test_qk_norm_makes_attention_invariant_to_query_key_scale():
    torch.manual_seed(0)
    model = GPT(with_overrides(TINY, vocab_size=64, qk_norm=True)).double().eval()
    idx = torch.randint(0, 64, (1, 12))
    before = model(idx, idx)[1]
    with torch.no_grad():
        for block in model.transformer.h:
            block.attn.c_attn.weight[: 2 * 64] *= 7.0  # scale queries and keys
    torch.testing.assert_close(model(idx, idx)[1], before, rtol=1e-6, atol=1e-6)  # norms compute in fp32


# --- attention within documents (doc_mask) ---------------------------------------------------------------------

DOC = 63  # the tiny vocabulary's document token


def rows_with_documents(*lengths_per_row) -> torch.Tensor:
    """Rows of random tokens (none of them DOC) with a DOC at the start of each document after the first."""
    rows = []
    for lengths in lengths_per_row:
        docs = [torch.randint(0, DOC, (n,)) for n in lengths]
        for doc in docs[1:]:
            doc[0] = DOC
        rows.append(torch.cat(docs))
    return torch.stack(rows)


@pytest.mark.parametrize("window, kind", [(0, "sliding"), (8, "chunked")])
def test_with_doc_mask_a_document_is_scored_as_if_it_were_its_own_row(window, kind):
    # Rotary attention depends on relative positions only, so a document met mid-row must get the logits it
    # gets at the start of a row of its own (to the fp32 rotary tables' rounding): nothing before its DOC
    # token reaches it. (Chunked blocks are aligned to the row: the documents start on block boundaries here.)
    torch.manual_seed(0)
    config = with_overrides(TINY, vocab_size=64, n_layer=2, attn_impl="manual", doc_mask=True,
                            window=window, window_kind=kind, window_pattern="LG" if window else "L")
    model = GPT(config).double().eval()
    idx = rows_with_documents((16, 16), (8, 24))
    logits = model(idx, idx)[0]
    torch.testing.assert_close(logits[0, 16:], model(idx[:1, 16:], idx[:1, 16:])[0][0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits[1, 8:], model(idx[1:, 8:], idx[1:, 8:])[0][0], rtol=1e-5, atol=1e-5)
    mixed = GPT(with_overrides(config, doc_mask=False)).double().eval()
    mixed.load_state_dict(model.state_dict())
    assert not torch.allclose(mixed(idx, idx)[0][0, 16:], logits[0, 16:], atol=1e-3)  # without it, the past leaks in
    torch.testing.assert_close(mixed(idx, idx)[0][0, :16], logits[0, :16])  # the first document is the same


@pytest.mark.parametrize("window, chunked", [(0, False), (8, True), (5, False)])
def test_flex_and_the_dense_fallback_keep_to_documents_as_manual_does(window, chunked):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 32, 16)
    k, v = torch.randn(2, 2, 32, 16), torch.randn(2, 2, 32, 16)
    docs = (rows_with_documents((5, 11, 16), (30, 2)) == DOC).cumsum(-1)
    expected = causal_attention(q, k, v, "manual", window, chunked=chunked, docs=docs)
    assert not torch.allclose(expected, causal_attention(q, k, v, "manual", window, chunked=chunked))
    torch.testing.assert_close(causal_attention(q, k, v, "flex", window, chunked=chunked, docs=docs), expected,
                               rtol=1e-4, atol=1e-5)
    q.requires_grad_()  # FlexAttention has no backward on a CPU: the dense fallback, which must keep the documents
    torch.testing.assert_close(causal_attention(q, k, v, "flex", window, chunked=chunked, docs=docs), expected,
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("impl, kind, notice", [
    ("flex", "chunked", None),  # FlexAttention unfused on a CPU
    ("varlen", "sliding", "notice: varlen attention has no CPU or fp32 kernel")])  # the dense fallback, said once
def test_a_doc_mask_model_trains_through_each_kernel_as_through_manual(impl, kind, notice, capsys):
    torch.manual_seed(0)
    config = with_overrides(TINY, vocab_size=64, doc_mask=True, window=8, window_pattern="LG", window_kind=kind,
                            attn_impl="manual")
    manual = GPT(config).double()
    fused = GPT(with_overrides(config, attn_impl=impl)).double()
    fused.load_state_dict(manual.state_dict())
    idx = rows_with_documents((10, 22), (32,))
    for model in (manual, fused):
        model(idx, idx)[1].backward()
    for a, b in zip(manual.parameters(), fused.parameters()):
        torch.testing.assert_close(a.grad, b.grad)
    if notice:
        assert capsys.readouterr().err.count(notice) == 1


def test_document_ids_count_the_documents_begun_at_or_before_each_position():
    from train_gpt2 import document_ids
    idx = torch.tensor([[5, 7, DOC, 1, DOC, DOC, 2], [DOC, 1, 2, 3, 4, 5, 6]])
    assert document_ids(idx, DOC).tolist() == [[0, 0, 1, 1, 2, 3, 3], [1, 1, 1, 1, 1, 1, 1]]


def test_document_spans_start_at_every_row_and_every_document():
    from train_gpt2 import document_ids, document_spans
    idx = torch.tensor([[5, 7, DOC, 1, DOC, DOC, 2], [DOC, 1, 2, 3, 4, 5, 6], [1, 2, 3, 4, 5, 6, 7]])
    # Row 1 continues row 0's last document number (and row 2 its own 0), yet each row begins a span.
    assert document_spans(document_ids(idx, DOC)).tolist() == [0, 2, 4, 5, 7, 14, 21]


def reference_varlen_attn(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, window_size=(-1, -1)):
    """torch.nn.attention.varlen.varlen_attn's documented result, by plain softmax: each sequence of the packed
    (total, H, D) tensors attends within itself, key j seen from query i where i - left <= j <= i + right."""
    assert torch.equal(cu_seq_q, cu_seq_k) and cu_seq_q.dtype == torch.int32 and max_q >= int(cu_seq_q.diff().max())
    left, right = window_size
    out = torch.empty_like(q)
    for start, end in zip(cu_seq_q[:-1].tolist(), cu_seq_q[1:].tolist()):
        i = torch.arange(end - start)
        seen = (i[None, :] <= i[:, None] + right) & ((left < 0) | (i[None, :] >= i[:, None] - left))
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k[start:end]) / q.size(-1) ** 0.5
        out[start:end] = torch.einsum("hqk,khd->qhd", scores.masked_fill(~seen, float("-inf")).softmax(-1),
                                      v[start:end])
    return out


@pytest.mark.parametrize("window", [0, 5])
def test_varlen_attention_keeps_to_documents_as_manual_does(window, monkeypatch):
    # The flash kernel runs on CUDA only: here its documented result stands in, so that what the trainer hands it
    # (the rows laid end to end, the documents' spans, grouped heads repeated, the window as (left, right)) is
    # checked against the definition.
    import torch.nn.attention.varlen as varlen
    from train_gpt2 import document_attention, document_spans
    monkeypatch.setattr(varlen, "varlen_attn", reference_varlen_attn)
    torch.manual_seed(0)
    q = torch.randn(2, 4, 32, 16, dtype=torch.float64)
    k, v = torch.randn(2, 2, 32, 16, dtype=torch.float64), torch.randn(2, 2, 32, 16, dtype=torch.float64)
    docs = (rows_with_documents((5, 11, 16), (30, 2)) == DOC).cumsum(-1)
    expected = causal_attention(q, k, v, "manual", window, docs=docs)
    torch.testing.assert_close(document_attention(q, k, v, document_spans(docs), window), expected)


@pytest.mark.parametrize("impl, kind", [("flex", "chunked"), ("varlen", "sliding")])
def test_a_doc_mask_run_trains_and_records_the_setting(tmp_path, shards, capsys, impl, kind):
    import json
    from conftest import tiny_run_args
    from train_gpt2 import main
    extra = ["--doc_mask", "true", "--attn_impl", impl, "--window", "8", "--window_kind", kind]
    assert main(tiny_run_args(shards, tmp_path, "run", *extra)) == 0
    capsys.readouterr()
    config = json.loads((tmp_path / "run" / "config.json").read_text())["model_config"]
    assert (config["doc_mask"], config["attn_impl"]) == (True, impl)
    assert json.loads((tmp_path / "run" / "summary.json").read_text())["status"] == "completed"
