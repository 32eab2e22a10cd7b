"""Shared pieces of the format tests: a tiny Llama with a tiny byte-level BPE tokenizer (fast to
write and to parse as GGUF), quantization helpers, and what "the same model" means.

Dimensions are multiples of 32 (every GPTQ/GGUF reader needs whole 32-element blocks); the test
files import the fixtures below by name.
"""

from __future__ import annotations

import copy

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from optc.compress.quant import QuantParams
from optc.methods import Workspace
from optc.methods.rtn import RTNStage, run_rtn

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. " * 3,
    "Quantization maps weights onto a grid of integers and scales, group by group.",
    "GPTQ, AWQ and GGUF files must compute what the report says: 1234 + 5678 = 6912.",
] * 20
TEXT = "The quick fox maps 42 weights onto a grid."


def make_tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|im_end|>",
    )


def make_model(vocab: int, seed: int = 0, tie: bool = True) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=tie, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).eval()
    # Random init gives norms of exactly 1; perturb them so a lost norm would show in the logits.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def quantize_rtn(model: torch.nn.Module, tokenizer, **scheme) -> tuple[torch.nn.Module, dict[str, QuantParams]]:
    """A fake-quantized copy of ``model`` (every decoder Linear) and its grids."""
    model = copy.deepcopy(model)
    ws = Workspace(model, tokenizer)
    run_rtn(ws, RTNStage(type="rtn", scheme=scheme))
    return model, ws.qparams


def logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits.float()


def fp16_tolerance(reference: torch.Tensor) -> float:
    """Max abs logit difference explained by storing scales (or weights) as float16.

    float16 keeps 11 significant bits, so each weight moves by at most 2^-11 of itself; through two
    layers that stays a few units of 2^-11 of the logits' scale.
    """
    return 8 * 2.0**-11 * float(reference.abs().max())


@pytest.fixture(scope="module")
def tiny_tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


@pytest.fixture(scope="module")
def tiny_lm(tiny_tokenizer) -> LlamaForCausalLM:
    return make_model(len(tiny_tokenizer))


@pytest.fixture(scope="module")
def tiny_ids(tiny_tokenizer) -> torch.Tensor:
    return tiny_tokenizer(TEXT, return_tensors="pt").input_ids


def test_tiny_tokenizer_round_trips(tiny_tokenizer) -> None:
    ids = tiny_tokenizer(TEXT).input_ids
    assert len(ids) < len(TEXT)  # merges were learned
    assert tiny_tokenizer.decode(ids) == TEXT


def test_fp16_tolerance_is_tight() -> None:
    x = torch.tensor([3.0, -10.0])
    assert fp16_tolerance(x) == pytest.approx(10 * 8 / 2048)
