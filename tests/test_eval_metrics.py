"""Evaluation metrics on tiny models: perplexity by hand, intervals, paired change, KL, size, cache."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from optc.errors import OptcError
from optc.evaluate.kl import DivergenceAccumulator, token_kl
from optc.evaluate.perplexity import (
    evaluate_windows,
    evaluation_token_cache,
    mean_ci,
    paired_difference,
    perplexity,
    tokenizer_fingerprint,
)
from optc.evaluate.size import parameter_counts, safetensors_tensor_bytes, size_metrics
from optc.testing import VOCAB, tiny_model


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    return tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (64 * 12 + 5,), generator=g)


def _hand_nll(model: torch.nn.Module, window: torch.Tensor, first: int) -> tuple[float, int]:
    """Sum of -log p(token t | tokens < t) for t >= max(first, 1), one position at a time."""
    with torch.no_grad():
        logits = model(input_ids=window[None]).logits[0].double()
    total, n = 0.0, 0
    for t in range(max(first, 1), window.numel()):
        total -= float(torch.log_softmax(logits[t - 1], dim=-1)[window[t]])
        n += 1
    return total, n


def test_perplexity_equals_hand_computation(model, tokens) -> None:
    res = perplexity(model, tokens, seqlen=64, windows=5)
    total, count, per_window = 0.0, 0, []
    for w in range(5):
        nll, n = _hand_nll(model, tokens[w * 64 : (w + 1) * 64], 0)
        total, count = total + nll, count + n
        per_window.append(nll / n)
    assert res.tokens == count == 5 * 63
    assert res.perplexity == pytest.approx(math.exp(total / count), rel=1e-5)
    assert res.window_nll == pytest.approx(per_window, rel=1e-5)
    # The interval is the t-interval of the per-window NLLs, mapped through exp.
    mean, lo, hi = mean_ci(torch.tensor(per_window))
    assert res.ci95[0] == pytest.approx(math.exp(lo), rel=1e-5) and res.ci95[1] == pytest.approx(math.exp(hi), rel=1e-5)


def test_strided_windows_score_only_new_tokens(model, tokens) -> None:
    res = perplexity(model, tokens, seqlen=64, windows=3, stride=16)
    # Window 0 scores 63 targets, later windows their last 16 tokens only.
    assert res.tokens == 63 + 16 + 16 and res.stride == 16
    nll1, n1 = _hand_nll(model, tokens[16:80], 48)
    assert n1 == 16 and res.window_nll[1] == pytest.approx(nll1 / 16, rel=1e-5)


def test_batched_windows_match_one_at_a_time(model, tokens) -> None:
    one = perplexity(model, tokens, seqlen=64, windows=6, batch_size=1)
    four = perplexity(model, tokens, seqlen=64, windows=6, batch_size=4)
    assert four.window_nll == pytest.approx(one.window_nll, rel=1e-5)


def test_interval_shrinks_with_more_windows(model) -> None:
    g = torch.Generator().manual_seed(3)
    long = torch.randint(0, VOCAB, (32 * 200,), generator=g)
    widths = []
    for n in (4, 16, 64):
        lo, hi = perplexity(model, long, seqlen=32, windows=n).ci95
        widths.append(hi - lo)
    assert widths[0] > widths[1] > widths[2] > 0


def test_one_window_has_no_interval(model, tokens) -> None:
    assert perplexity(model, tokens, seqlen=64, windows=1).ci95 == (None, None)


def test_text_shorter_than_one_window_refused(model) -> None:
    with pytest.raises(OptcError, match="shorter than one window"):
        perplexity(model, torch.arange(50) % VOCAB, seqlen=64)


def test_seqlen_above_context_refused(model, tokens) -> None:
    with pytest.raises(OptcError, match="above the model's context length 256"):
        perplexity(model, torch.arange(600) % VOCAB, seqlen=512)


def test_baseline_pass_pairs_windows_and_kl_is_zero_for_the_same_model(model, tokens) -> None:
    res = evaluate_windows(model, tokens, 64, 4, baseline=model)
    assert res.baseline.window_nll == pytest.approx(res.model.window_nll)
    assert res.divergence.kl_mean == pytest.approx(0, abs=1e-6)
    assert res.divergence.top1_agreement == 1.0 and res.divergence.tokens == 4 * 63
    change = paired_difference(res.baseline, res.model)
    assert change["ppl_increase_pct"] == pytest.approx(0, abs=1e-6)
    assert change["significant"] is False


def test_paired_difference_detects_a_real_regression(model, tokens) -> None:
    worse = copy.deepcopy(model)
    with torch.no_grad():
        for p in worse.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    res = evaluate_windows(worse, tokens, 64, 8, baseline=model)
    change = paired_difference(res.baseline, res.model)
    expected = 100 * (res.model.perplexity / res.baseline.perplexity - 1)
    assert change["ppl_increase_pct"] == pytest.approx(expected, rel=1e-6)
    lo, hi = change["ppl_increase_pct_ci95"]
    assert lo < change["ppl_increase_pct"] < hi
    assert lo > 0 and change["significant"] is True  # the whole interval says "worse"
    assert res.divergence.kl_mean > 0 and res.divergence.kl_max >= res.divergence.kl_p99 >= 0


def test_token_kl_matches_definition() -> None:
    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(700, 50, generator=g), torch.randn(700, 50, generator=g)
    kl, agree = token_kl(p_logits, q_logits)
    p, q = torch.softmax(p_logits.double(), -1), torch.softmax(q_logits.double(), -1)
    assert kl == pytest.approx((p * (p.log() - q.log())).sum(-1), rel=1e-4, abs=1e-6)
    assert torch.equal(agree, p.argmax(-1) == q.argmax(-1))
    acc = DivergenceAccumulator()
    acc.update(p_logits[:300], q_logits[:300])
    acc.update(p_logits[300:], q_logits[300:])
    r = acc.result()
    assert r.kl_mean == pytest.approx(float(kl.mean()), rel=1e-6) and r.kl_max == pytest.approx(float(kl.max()))
    assert r.top1_agreement == pytest.approx(float(agree.double().mean())) and r.windows == 2


def test_token_cache_is_keyed_by_tokenizer_and_text(default_tokenizer, tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("OPTC_CACHE", str(tmp_path / "cache"))
    text = tmp_path / "eval.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 50)
    first = evaluation_token_cache(default_tokenizer, str(text))
    files = list((tmp_path / "cache" / "tokens").glob("*.safetensors"))
    assert len(files) == 1 and tokenizer_fingerprint(default_tokenizer) in files[0].name
    assert torch.equal(evaluation_token_cache(default_tokenizer, str(text)), first)  # from disk
    text.write_text("Another text entirely. " * 50)  # edited file: new key, never stale ids
    second = evaluation_token_cache(default_tokenizer, str(text))
    assert not torch.equal(first[: second.numel()], second[: first.numel()])
    assert len(list((tmp_path / "cache" / "tokens").glob("*.safetensors"))) == 2
    assert torch.equal(second, evaluation_token_cache(default_tokenizer, str(text), use_cache=False))


def test_size_metrics_from_safetensors_headers(tiny_checkpoint: Path) -> None:
    from optc.model.load import load_model

    loaded = load_model(str(tiny_checkpoint))
    size = size_metrics(loaded.model, tiny_checkpoint)
    params, nonzero = parameter_counts(loaded.model)
    assert size["parameters"] == params and size["nonzero"] == nonzero
    stored = sum(safetensors_tensor_bytes(tiny_checkpoint / "model.safetensors").values())
    assert size["weight_bytes"] == stored
    assert size["bits_per_weight"] == pytest.approx(32, rel=1e-3)  # float32, tied head stored once
    assert size["compression_ratio"] == pytest.approx(0.5, rel=1e-3)
    assert size["linear_bits_per_weight"] == pytest.approx(32, rel=1e-3)
    assert size["bytes_on_disk"] > stored
