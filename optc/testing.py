"""Tiny random models built in-process, for tests and examples (no downloads)."""

from __future__ import annotations

import torch
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    MistralConfig,
    OPTConfig,
    PretrainedConfig,
    Qwen2Config,
)

VOCAB = 128


def tiny_config(arch: str) -> PretrainedConfig:
    """A small config of the named architecture; sizes chosen so groups of 32 do not divide."""
    if arch == "llama":
        return LlamaConfig(
            vocab_size=VOCAB, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
            tie_word_embeddings=True,
        )
    if arch == "qwen2":
        return Qwen2Config(
            vocab_size=VOCAB, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
        )
    if arch == "mistral":
        return MistralConfig(
            vocab_size=VOCAB, hidden_size=96, intermediate_size=200, num_hidden_layers=2,
            num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=256,
        )
    if arch == "opt":
        return OPTConfig(
            vocab_size=VOCAB, hidden_size=96, ffn_dim=200, num_hidden_layers=2,
            num_attention_heads=6, max_position_embeddings=256, word_embed_proj_dim=96,
        )
    if arch == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB, n_embd=96, n_layer=2, n_head=6, n_positions=256,
            bos_token_id=0, eos_token_id=1,
        )
    raise ValueError(f"unknown tiny architecture {arch!r}")


TINY_ARCHS = ("llama", "qwen2", "mistral", "opt", "gpt2")


def tiny_model(arch: str = "llama", seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    cfg = tiny_config(arch)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager")
    model.eval()
    return model


def tiny_tokens(n: int = 8, seqlen: int = 32, seed: int = 0) -> torch.Tensor:
    """Token ids with some structure (a repeating walk), so activations are not pure noise."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    steps = torch.randint(1, 4, (n, seqlen), generator=g).cumsum(dim=1)
    return (start + steps) % VOCAB


def write_random_model(
    directory, config: PretrainedConfig, tokenizer=None, *, seed: int = 0, std: float = 0.02,
    dtype: torch.dtype = torch.float32, max_shard_bytes: int = 2 * 1024**3,
):
    """A randomly initialised model of ``config`` saved as a Hugging Face safetensors directory,
    generated and written one tensor at a time, so a model far larger than memory can be made.

    Matrices are N(0, std^2), norm weights 1, biases 0; each tensor has its own seeded generator,
    so the files depend only on ``config`` and ``seed``.
    """
    from pathlib import Path

    from accelerate import init_empty_weights

    from optc.model.safetensors_io import model_state_dict
    from optc.model.safetensors_io import Lazy, write_sharded

    directory = Path(directory)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.tie_weights()

    def make(i: int, key: str, shape: tuple[int, ...]):
        def tensor() -> torch.Tensor:
            if len(shape) == 1:
                return (torch.ones if key.endswith(".weight") else torch.zeros)(shape, dtype=dtype)
            g = torch.Generator().manual_seed(seed * 1_000_003 + i)
            return (torch.randn(shape, generator=g) * std).to(dtype)
        return tensor

    entries = {}
    for i, (key, t) in enumerate(model_state_dict(model).items()):
        entries[key] = t if not t.is_meta else Lazy(make(i, key, tuple(t.shape)), dtype, tuple(t.shape))
    write_sharded(entries, directory, max_shard_bytes)
    config.architectures = [type(model).__name__]
    config.save_pretrained(directory)
    if tokenizer is not None:
        tokenizer.save_pretrained(directory)
    return directory
