"""Names optc stores beside a GGUF source's tokenizer, without torch (the format registry, which
must import light, reads them)."""

from __future__ import annotations

# The tokenizer keeps a GGUF source's llama.cpp pre-tokenizer name under this key (saved in
# tokenizer_config.json): transformers maps e.g. SmolLM's ``smollm`` to a plain byte-level
# pre-tokenizer, from which the name cannot be recovered, and llama.cpp refuses names it does not know.
GGUF_PRE_TOKENIZER_KEY = "gguf_pre_tokenizer"
