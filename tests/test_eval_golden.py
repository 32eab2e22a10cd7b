"""Golden numbers on the fixed protocol (slow: ~10 minutes on 2 CPU cores).

The default model in float32, WikiText-2 test tokenized whole, the first 40 non-overlapping
2048-token windows. optc's evaluation must agree with a plain transformers loop (the
computation of bench/hf_ppl.py) to 4 significant digits and take at most 1.05x its time,
both measured in this one process.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from optc.evaluate.protocol import EvalProtocol
from optc.run.pipeline import evaluate_model

pytestmark = [pytest.mark.slow, pytest.mark.real_model]

TEST_TEXT = Path(os.environ.get("OPTC_DATA", "/work/shared/data")) / "wikitext-2-raw-test.txt"
SEQLEN, WINDOWS = 2048, 40


def _plain_loop(model, ids: torch.Tensor, windows: range) -> tuple[float, int, float]:
    """(sum of NLL, scored tokens, seconds) of the plain transformers loop over ``windows``."""
    nll, count = 0.0, 0
    t0 = time.perf_counter()
    with torch.inference_mode():
        for w in windows:
            x = ids[w * SEQLEN : (w + 1) * SEQLEN][None]
            loss = model(input_ids=x, labels=x).loss  # mean over seqlen - 1 targets
            nll += float(loss) * (x.shape[1] - 1)
            count += x.shape[1] - 1
    return nll, count, time.perf_counter() - t0


def test_fixed_protocol_matches_plain_transformers(default_model_dir: Path) -> None:
    if not TEST_TEXT.is_file():
        pytest.skip(f"{TEST_TEXT} not present (set OPTC_DATA)")
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(default_model_dir)
    ids = tok(TEST_TEXT.read_text(encoding="utf-8"), add_special_tokens=False, return_tensors="pt").input_ids[0]
    evaluate_model("smollm2-135m", EvalProtocol(dataset=str(TEST_TEXT), seqlen=SEQLEN, windows=1))  # warm the token cache
    # The plain loop's halves run before and after optc, so a machine whose load drifts
    # during the test (other jobs) slows both sides alike.
    nll_a, n_a, s_a = _plain_loop(model, ids, range(WINDOWS // 2))
    t0 = time.perf_counter()
    report = evaluate_model("smollm2-135m", EvalProtocol(dataset=str(TEST_TEXT), seqlen=SEQLEN, windows=WINDOWS))
    optc_total = time.perf_counter() - t0
    nll_b, n_b, s_b = _plain_loop(model, ids, range(WINDOWS // 2, WINDOWS))
    plain_ppl, plain_s = math.exp((nll_a + nll_b) / (n_a + n_b)), s_a + s_b
    optc_ppl = report["metrics"]["perplexity_model"]["perplexity"]
    print(f"\noptc ppl {optc_ppl:.6f} (perplexity {report['timings']['perplexity']:.1f} s, whole eval "
          f"{optc_total:.1f} s); plain transformers ppl {plain_ppl:.6f} ({plain_s:.1f} s); "
          f"ratio {optc_total / plain_s:.3f}")
    assert f"{optc_ppl:.4g}" == f"{plain_ppl:.4g}"
    assert abs(optc_ppl - 20.38) < 0.01
    assert optc_total <= 1.05 * plain_s


def test_compressed_tensors_checkpoint_matches_transformers_reader(tmp_path: Path) -> None:
    """optc's reader and transformers + compressed-tensors agree on the same checkpoint."""
    pytest.importorskip("compressed_tensors")
    if not TEST_TEXT.is_file():
        pytest.skip(f"{TEST_TEXT} not present (set OPTC_DATA)")
    from optc.recipe import load_recipe
    from optc.run.pipeline import run_recipe

    out = tmp_path / "w4"
    recipe = load_recipe("w4a16-rtn")
    recipe.evaluation = None
    run_recipe(recipe, out)
    windows = 4
    ours = evaluate_model(str(out), EvalProtocol(dataset=str(TEST_TEXT), seqlen=SEQLEN, windows=windows))
    ours_ppl = ours["metrics"]["perplexity_model"]["perplexity"]
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok(TEST_TEXT.read_text(encoding="utf-8"), add_special_tokens=False, return_tensors="pt").input_ids[0]
    nll = 0.0
    with torch.inference_mode():
        for w in range(windows):
            x = ids[w * SEQLEN : (w + 1) * SEQLEN][None]
            nll += float(model(input_ids=x, labels=x).loss)
    theirs = math.exp(nll / windows)
    print(f"\noptc reader {ours_ppl:.4f}, transformers + compressed-tensors {theirs:.4f}")
    assert abs(ours_ppl / theirs - 1) < 0.005
