"""llama.cpp's named GGUF mixes (Q2_K, Q3_K_S/M/L, Q4_K_S/M, Q5_K_S/M, Q6_K): the type of every
tensor, by llama.cpp's own rules.

Read from llama.cpp's ``src/llama-quant.cpp`` (``llama_tensor_get_type_impl`` and
``tensor_type_fallback``) for dense (non-MoE) models other than Falcon:

- the output matrix (and, when the embedding is tied to it, the token embedding) is Q8_0 when its
  rows are not whole blocks of the mix's type, else Q6_K;
- ``attn_v``, ``ffn_down``, ``attn_output`` and ``attn_qkv`` take more bits in some mixes, some
  only in the layers ``use_more_bits`` picks (the first and last eighth, and every third between);
- a type whose 256-weight super-blocks do not divide a row's length falls back to a 32-weight
  type (Q2_K, Q3_K -> Q4_0; Q4_K -> Q5_0; Q5_K -> Q5_1; Q6_K -> Q8_0), and to F16 when 32 does
  not divide it either. The default model's hidden size, 576, makes every matrix but ``ffn_down``
  (rows of 1536) fall back.

Pure data and one function over tensor names: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

# Weights per block of each type the GGUF writer stores.
BLOCK_OF = {"q4_0": 32, "q4_1": 32, "q5_0": 32, "q5_1": 32, "q8_0": 32, "f16": 1,
            "q2_k": 256, "q3_k": 256, "q4_k": 256, "q5_k": 256, "q6_k": 256}
# Stored bits per weight of each type (block bytes * 8 / block weights; ggml-common.h).
GGUF_STORED_BITS = {"q4_0": 4.5, "q4_1": 5.0, "q5_0": 5.5, "q5_1": 6.0, "q8_0": 8.5, "f16": 16.0,
                    "q2_k": 2.625, "q3_k": 3.4375, "q4_k": 4.5, "q5_k": 5.5, "q6_k": 6.5625}
FALLBACK = {"q2_k": "q4_0", "q3_k": "q4_0", "q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}


@dataclass(frozen=True)
class Mix:
    """One named mix: llama.cpp's file type (``LLAMA_FTYPE_MOSTLY_*``) and its base tensor type."""

    file_type: int
    base: str


MIXES: dict[str, Mix] = {
    "q2_k": Mix(10, "q2_k"),
    "q3_k_s": Mix(11, "q3_k"),
    "q3_k_m": Mix(12, "q3_k"),
    "q3_k_l": Mix(13, "q3_k"),
    "q4_k_s": Mix(14, "q4_k"),
    "q4_k_m": Mix(15, "q4_k"),
    "q5_k_s": Mix(16, "q5_k"),
    "q5_k_m": Mix(17, "q5_k"),
    "q6_k": Mix(18, "q6_k"),
}


@dataclass(frozen=True)
class TensorType:
    """What a mix stores one tensor as: ``qtype``, and ``wanted`` when that was a type whose
    blocks do not divide the rows (llama.cpp's fallback), else None."""

    qtype: str
    wanted: str | None = None


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def _role(name: str) -> str:
    """llama.cpp's tensor category of a GGUF tensor name (``blk.3.attn_v.weight`` -> ``attn_v``)."""
    stem = name.removesuffix(".weight")
    return stem.split(".")[-1] if stem.startswith("blk.") else stem


def mix_types(mix: str, tensors: list[tuple[str, int]], *, tied: bool, n_head: int, n_head_kv: int,
              n_layer: int) -> dict[str, TensorType]:
    """The type of each 2-D weight ``(GGUF name, row length)`` in file order under ``mix``."""
    ftype = mix
    base = MIXES[mix].base
    n_gqa = n_head // max(1, n_head_kv)
    n_wv = sum(1 for n, _ in tensors if _role(n) == "attn_v")
    n_down = sum(1 for n, _ in tensors if _role(n) == "ffn_down")
    i_wv = i_down = 0
    out: dict[str, TensorType] = {}
    for name, cols in tensors:
        role = _role(name)
        t = base
        if role == "output" or (tied and role == "token_embd"):
            t = "q8_0" if cols % BLOCK_OF[base] else "q6_k"
        elif role == "attn_v":
            if ftype == "q2_k":
                t = "q4_k" if n_gqa >= 4 else "q3_k"
            elif ftype == "q3_k_m":
                t = "q5_k" if i_wv < 2 else "q4_k"
            elif ftype == "q3_k_l":
                t = "q5_k"
            elif ftype in ("q4_k_m", "q5_k_m") and _use_more_bits(i_wv, n_wv):
                t = "q6_k"
            elif ftype == "q4_k_s" and i_wv < 4:
                t = "q5_k"
            if n_layer == 80 and t in ("q3_k", "q4_k"):  # llama.cpp's 70B rule (8 heads share attn_v)
                t = "q5_k"
            i_wv += 1
        elif role == "ffn_down":
            if ftype == "q2_k":
                t = "q3_k"
            elif ftype == "q3_k_m":
                t = "q5_k" if i_down < n_down // 16 else "q4_k"
            elif ftype == "q3_k_l":
                t = "q5_k"
            elif ftype in ("q4_k_m", "q5_k_m") and _use_more_bits(i_down, n_down):
                t = "q6_k"
            elif ftype == "q4_k_s" and i_down < n_down // 8:
                t = "q5_k"
            i_down += 1
        elif role == "attn_output":
            t = {"q2_k": "q3_k", "q3_k_m": "q4_k", "q3_k_l": "q5_k"}.get(ftype, t)
        elif role == "attn_qkv":
            t = {"q3_k_m": "q4_k", "q3_k_l": "q4_k", "q4_k_m": "q5_k", "q5_k_m": "q6_k"}.get(ftype, t)
        out[name] = _fit(t, cols)
    return out


def _fit(t: str, cols: int) -> TensorType:
    if cols % BLOCK_OF[t] == 0:
        return TensorType(t)
    fallback = FALLBACK.get(t, t)
    return TensorType(fallback if cols % BLOCK_OF[fallback] == 0 else "f16", wanted=t)
