"""GGUF files for llama.cpp users (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16), written with the ``gguf`` package.

Block types (ggml ``ggml-common.h``; gguf-py ``quants.py``, checked against the installed gguf).
Each holds 32 consecutive weights of a row (along the input dimension):

- ``Q4_0`` (18 bytes): a float16 ``d``, then 16 bytes ``qs`` where byte ``j`` holds element ``j``
  in its low nibble and element ``j + 16`` in its high nibble; ``x = d * (u - 8)``.
- ``Q4_1`` (20 bytes): float16 ``d`` and ``m``, then ``qs`` as in Q4_0; ``x = d * u + m``.
- ``Q5_0`` (22 bytes): float16 ``d``, a little-endian uint32 ``qh`` whose bit ``j`` is the fifth
  bit of element ``j``, then ``qs`` (the low four bits) as in Q4_0; ``x = d * (u - 16)``.
- ``Q5_1`` (24 bytes): float16 ``d`` and ``m``, ``qh`` and ``qs`` as in Q5_0; ``x = d * u + m``.
- ``Q8_0`` (34 bytes): a float16 ``d`` and 32 int8 ``q``; ``x = d * q``.

Mapping optc's grids (``W = (q - z) * s`` per group along the input dimension, ``q`` in
``[qmin, qmax]``): every 32-weight block must lie inside one group. The centred types (Q4_0,
Q5_0, Q8_0) store ``u = q - z + 2^(B-1)``, so they hold a grid whose integers ``q - z`` fit
``[-2^(B-1), 2^(B-1) - 1]`` (symmetric grids of up to B bits, asymmetric ones of up to B - 1), and
the file computes what optc computed with ``d = s`` rounded to float16. The types with a min
(Q4_1, Q5_1) store ``u = q - qmin`` and ``m = d * (qmin - z)``, so they hold any grid of up to B
bits; their integers are exact and ``m`` is rounded to float16 as the format stores it (a
relative error of at most 2^-11 of the block's offset). Otherwise the weights are re-quantized
by gguf's reference (round-to-nearest) quantizer, and the summary says which modules were.

Llama-family layout (llama.cpp ``convert_hf_to_gguf.py``, which transformers' GGUF loader undoes):
tensor names from ``gguf.get_tensor_name_map``; for ``llama`` the rows of ``q_proj``/``k_proj``
are permuted from HF's half-split rotary layout to llama.cpp's interleaved one. Row permutations
keep each row's blocks intact, so exactness survives them.
"""

from __future__ import annotations

import functools
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import optc
from optc.errors import OptcError
from optc.export.gguf_mix import BLOCK_OF, FALLBACK, GGUF_STORED_BITS, MIXES, TensorType, mix_types
from optc.export.imatrix import Imatrix, check_imatrix, read_imatrix
from optc.export.registry import Format
from optc.export.source import ExportSource, ModelSource, integer_grid, refuse_activations
from optc.model.gguf_index import read_gguf_index
from optc.model.gguf_keys import GGUF_PRE_TOKENIZER_KEY

if TYPE_CHECKING:
    import numpy as np
    import torch

    from optc.compress.kquant import KQuant
    from optc.compress.quant import QuantParams, QuantScheme

log = logging.getLogger(__name__)

BLOCK = 32


@dataclass(frozen=True)
class BlockType:
    """One GGUF type optc writes: ``bits`` per stored integer (None: a float type), whether each
    block carries a min (``x = d * u + m``) or is centred (``x = d * (u - 2^(bits-1))``), llama.cpp's
    file type, and the stored bits per weight (block bytes * 8 / 32)."""

    bits: int | None
    with_min: bool
    file_type: int  # LlamaFileType.MOSTLY_*
    stored_bits: float

    def span(self) -> tuple[int, int]:
        """The integers ``q - z`` a centred type holds."""
        return -(2 ** (self.bits - 1)), 2 ** (self.bits - 1) - 1


GGUF_TYPES: dict[str, BlockType] = {
    "q4_0": BlockType(4, False, 2, 4.5),
    "q4_1": BlockType(4, True, 3, 5.0),
    "q5_0": BlockType(5, False, 8, 5.5),
    "q5_1": BlockType(5, True, 9, 6.0),
    "q8_0": BlockType(8, False, 7, 8.5),
    "f16": BlockType(None, False, 1, 16.0),
}
# HF model_type -> (gguf architecture, permute q/k rows for llama.cpp's rotary layout)
ARCHITECTURES = {"llama": ("llama", True), "qwen2": ("qwen2", False)}


def _ggml_type(qtype: str):
    from gguf import GGMLQuantizationType

    return GGMLQuantizationType[qtype.upper()]


# The pseudo type of a file whose decoder Linears each take the GGUF type that holds their own
# grid (a budget's mix of schemes), and llama.cpp's file type for a file of no one type.
PER_SCHEME = "scheme"
FILE_TYPE_GUESSED = 1024  # LLAMA_FTYPE_GUESSED


def check_qtype(qtype: str) -> str:
    """A block type of ``GGUF_TYPES``, a mix of ``MIXES`` or ``PER_SCHEME``, lower-cased."""
    qtype = qtype.lower()
    if qtype not in GGUF_TYPES and qtype not in MIXES and qtype != PER_SCHEME:
        raise OptcError(f"unknown GGUF type {qtype!r} (expected one of {', '.join([*GGUF_TYPES, *MIXES])})")
    return qtype


def _levels_misfit(scheme: QuantScheme, qtype: str) -> str | None:
    """Why ``qtype``'s blocks cannot hold ``scheme``'s integers, or None when they can."""
    bt = GGUF_TYPES[qtype]
    if bt.bits is None:
        return f"{qtype} is a float type"
    if bt.with_min:
        if scheme.bits > bt.bits:
            return f"{scheme.label()} weights need {scheme.bits}-bit integers, {qtype.upper()} blocks hold {bt.bits}"
        return None
    levels = (scheme.qmin, scheme.qmax) if scheme.symmetric else (-(2**scheme.bits - 1), 2**scheme.bits - 1)
    lo, hi = bt.span()
    if levels[0] < lo or levels[1] > hi:
        return (f"{scheme.label()} weights need integers in [{levels[0]}, {levels[1]}], "
                f"{qtype.upper()} blocks hold [{lo}, {hi}]")
    return None


# --- exact block encoding (pure tensor functions) ---------------------------------------------


def super_scales(scale: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A k-quant grid's group scales ([N, G]) as llama.cpp stores them: a float16 ``d`` per
    super-block ([N, K/256]) and integer codes ``sc`` ([N, K/256, S]) with ``d * sc`` equal to every
    scale bit for bit; None when some super-block's scales are not such multiples.

    ``d`` is not stored beside optc's grids: it is recovered as ``s / c`` for the scale ``s`` of
    largest magnitude and each code ``c`` that could hold it (any ``d`` that reproduces every scale
    stores the same weights)."""
    import torch

    from optc.compress.kquant import K_TYPES, QK_K

    kt = K_TYPES[kind]
    lo, hi = kt.scale_codes
    n, groups = scale.shape
    s = scale.float().reshape(n, groups * kt.group // QK_K, kt.subblocks)
    ext = s.gather(-1, s.abs().argmax(-1, keepdim=True))  # [N, nb, 1]
    codes = torch.tensor([c for c in range(lo, hi + 1) if c], dtype=torch.float32)
    d = (ext / codes).to(torch.float16).float()  # [N, nb, C]
    sc = torch.where(d[..., None] != 0, s[..., None, :] / d[..., None], torch.zeros(()))
    sc = sc.round_()
    ok = ((sc >= lo) & (sc <= hi) & (d[..., None] * sc == s[..., None, :])).all(-1)  # [N, nb, C]
    ok |= (ext == 0)  # an all-zero super-block: d = 0 and codes 0
    if not bool(ok.any(-1).all()):
        return None
    pick = ok.float().argmax(-1, keepdim=True)  # the first code that reproduces the super-block
    d_pick = d.gather(-1, pick)[..., 0]
    sc_pick = sc.gather(-2, pick[..., None].expand(-1, -1, 1, kt.subblocks))[..., 0, :]
    zero = ext[..., 0] == 0
    d_pick = torch.where(zero, torch.zeros_like(d_pick), d_pick)
    sc_pick = torch.where(zero[..., None], torch.zeros_like(sc_pick), sc_pick)
    return d_pick.to(torch.float16), sc_pick.to(torch.int16)


def _kblock_fit(p: QuantParams, qtype: str) -> str | None:
    if p.scheme.kquant_kind != qtype:
        return f"{qtype.upper()} super-blocks hold two-level scales, not {p.scheme.label()}'s"
    if p.g_idx.numel() % 256:
        return f"K={p.g_idx.numel()} is not a multiple of {qtype.upper()}'s 256-weight super-blocks"
    if p.actorder:
        return f"act-order (permuted) groups split {qtype.upper()}'s super-blocks"
    if super_scales(p.scale, qtype) is None:
        return f"the group scales are not float16 multiples of one scale per {qtype.upper()} super-block"
    if p.scheme.offset_grid and super_scales(p.zero, qtype) is None:
        return f"the group offsets are not float16 multiples of one min per {qtype.upper()} super-block"
    return None


def kblock_codes(w: torch.Tensor, p: QuantParams, qtype: str, name: str = "") -> KQuant:
    """``w`` on ``p``'s k-quant grid as the super-blocks store it (codes ``q + 2^(b-1)``)."""
    import torch

    from optc.compress.kquant import KQuant
    from optc.export.packing import grid_codes

    d, sc = super_scales(p.scale, qtype)
    q = grid_codes(name, w, p).to(torch.int16) + 2 ** (p.scheme.bits - 1)
    dmin, m = super_scales(p.zero, qtype) if p.scheme.offset_grid else (None, None)
    return KQuant(qtype, q.to(torch.uint8), d, sc, dmin, m)


def block_fit(p: QuantParams, qtype: str) -> str | None:
    """Why ``p``'s grid cannot be stored exactly as ``qtype`` blocks, or None when it can."""
    if BLOCK_OF.get(qtype) == 256:
        return _kblock_fit(p, qtype)
    if p.scheme.kquant_kind is not None:
        return f"{qtype.upper()} blocks hold one float16 scale per 32 weights, not {p.scheme.label()}'s"
    if reason := _levels_misfit(p.scheme, check_qtype(qtype)):
        return reason
    k = p.g_idx.numel()
    if k % BLOCK:
        return f"K={k} is not a multiple of {qtype.upper()}'s {BLOCK}-weight blocks"
    runs = p.g_idx.view(-1, BLOCK)
    if bool((runs != runs[:, :1]).any()):
        return f"groups of {p.scheme.group_size} columns split {qtype.upper()}'s {BLOCK}-weight blocks"
    return None


def block_codes(w: torch.Tensor, p: QuantParams, qtype: str, name: str = ""
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Stored integers ``u`` ([N, K] uint8), scales ``d`` and, for a type with a min, mins ``m``
    ([N, K/32] float16) of ``w`` on ``p``'s grid."""
    import torch

    from optc.export.packing import grid_codes

    bt = GGUF_TYPES[qtype]
    g_idx = p.g_idx.long()
    q = grid_codes(name, w, p).to(torch.int16)
    first = g_idx[::BLOCK]
    d = p.scale[:, first].to(torch.float16)
    if bt.with_min:
        m = (d.float() * (p.scheme.qmin - p.zero[:, first].float())).to(torch.float16)
        return (q - p.scheme.qmin).to(torch.uint8), d, m
    u = q - p.zero[:, g_idx].to(torch.int16) + 2 ** (bt.bits - 1)
    return u.to(torch.uint8), d, None


def encode_blocks(u: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, qtype: str) -> np.ndarray:
    """Raw ``qtype`` blocks ([N, K/32 * block bytes] uint8) of stored integers ``u``, scales ``d``
    and mins ``m``, laid out as the module docstring says."""
    import torch

    bits = GGUF_TYPES[qtype].bits
    n, k = u.shape
    nb = k // BLOCK
    u = u.view(n, nb, BLOCK)
    parts = [d.contiguous().view(torch.uint8).view(n, nb, 2)]
    if m is not None:
        parts.append(m.contiguous().view(torch.uint8).view(n, nb, 2))
    if bits == 8:
        parts.append(u ^ 0x80)  # two's complement bytes of u - 128
    else:
        if bits == 5:
            high = ((u >> 4) & 1).view(n, nb, 4, 8)
            weights = torch.tensor([1 << j for j in range(8)], dtype=torch.uint8)
            parts.append((high * weights).sum(-1, dtype=torch.uint8))  # qh, little-endian
        low = u & 0x0F
        parts.append(low[..., : BLOCK // 2] | (low[..., BLOCK // 2 :] << 4))
    return torch.cat(parts, dim=-1).reshape(n, -1).numpy()


def _bits_into(v: torch.Tensor, shift: int) -> torch.Tensor:
    """Pack ``v`` ([..., P, L] uint8, each < 2^shift) into [..., L] bytes: part ``p`` at bit ``shift * p``."""
    import torch

    out = torch.zeros(v.shape[:-2] + v.shape[-1:], dtype=torch.uint8)
    for p in range(v.shape[-2]):
        out |= v[..., p, :] << (shift * p)
    return out


def encode_kblocks(kq: KQuant) -> np.ndarray:
    """Raw super-blocks ([N, K/256 * block bytes] uint8) of a k-quant weight, laid out as
    ggml-common.h's ``block_q{2..6}_K`` (element order as ggml's ``dequantize_row_q*_K``)."""
    import torch

    from optc.compress.kquant import K_TYPES, QK_K

    kt = K_TYPES[kq.kind]
    n, k = kq.u.shape
    nb = k // QK_K
    u = kq.u.view(n, nb, QK_K)
    half = lambda t: t.contiguous().view(torch.uint8).view(n, nb, 2)  # noqa: E731 - float16 bytes
    sc = kq.sc.to(torch.uint8) if kq.kind != "q3_k" else (kq.sc + 32).to(torch.uint8)
    if kq.kind == "q6_k":
        ql = _bits_into((u & 0x0F).view(n, nb, 2, 2, 64), 4)  # element h*128 + nib*64 + l
        qh = _bits_into((u >> 4).view(n, nb, 2, 4, 32), 2)  # element h*128 + sh*32 + l
        parts = [ql.reshape(n, nb, 128), qh.reshape(n, nb, 64), kq.sc.to(torch.int8).view(torch.uint8), half(kq.d)]
    elif kt.group == 16:  # Q2_K, Q3_K: 2-bit planes, element h*128 + j*32 + l in byte h*32 + l, bits 2j
        qs = _bits_into((u & 0x03).view(n, nb, 2, 4, 32), 2).reshape(n, nb, 64)
        if kq.kind == "q2_k":
            parts = [sc | (kq.m.to(torch.uint8) << 4), qs, half(kq.d), half(kq.dmin)]
        else:
            hmask = _bits_into(((u >> 2) & 1).view(n, nb, 8, 32), 1)  # element j*32 + l: bit j of byte l
            low = sc & 0x0F
            packed = torch.cat([low[..., :8] | (low[..., 8:] << 4),
                                _bits_into((sc >> 4).view(n, nb, 4, 4), 2)], dim=-1)  # scale sh*4 + b: byte 8 + b
            parts = [hmask, qs, packed, half(kq.d)]
    else:  # Q4_K, Q5_K: 6-bit scale and min codes in 12 bytes, nibbles of sub-blocks 2c, 2c+1 in bytes c*32 + l
        m = kq.m.to(torch.uint8)
        scales = torch.cat([(sc[..., :4] & 63) | ((sc[..., 4:] >> 4) << 6),
                            (m[..., :4] & 63) | ((m[..., 4:] >> 4) << 6),
                            (sc[..., 4:] & 0x0F) | ((m[..., 4:] & 0x0F) << 4)], dim=-1)
        qs = _bits_into((u & 0x0F).view(n, nb, 4, 2, 32), 4).reshape(n, nb, 128)
        parts = [half(kq.d), half(kq.dmin), scales]
        if kq.kind == "q5_k":
            parts.append(_bits_into((u >> 4).view(n, nb, 8, 32), 1))  # bit j of byte l: element j*32 + l
        parts.append(qs)
    blocks = torch.cat(parts, dim=-1)
    assert blocks.shape[-1] == kt.block_bytes, (kq.kind, blocks.shape)
    return blocks.reshape(n, -1).numpy()


def permute_rotary_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """HF's half-split rotary rows of each head -> llama.cpp's interleaved pairs (convert_hf_to_gguf)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# --- tokenizer --------------------------------------------------------------------------------


def _pre_tokenizer_name(pre: dict | None) -> str:
    """llama.cpp's ``tokenizer.ggml.pre`` for a byte-level BPE pre-tokenizer we can recognise."""
    if pre and pre.get("type") == "ByteLevel" and pre.get("use_regex", True):
        return "gpt-2"  # llama.cpp's name (llama-vocab.cpp); it refuses "gpt2"
    if pre and pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers") or []
        splits = [p for p in parts if p.get("type") == "Split"]
        if len(splits) == 1:
            regex = (splits[0].get("pattern") or {}).get("Regex")
            try:
                from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
            except ImportError:
                GGUF_PRE_TOKENIZER_SPLITS = {}
            for name, pattern in GGUF_PRE_TOKENIZER_SPLITS.items():
                if pattern == regex:
                    return name
    log.warning("pre-tokenizer %s has no llama.cpp name known to optc; writing 'default'", pre)
    return "default"


def tokenizer_metadata(tokenizer) -> dict:
    """The ``tokenizer.ggml.*`` values of a byte-level BPE tokenizer (GPT-2 style, ``gpt2`` model)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise OptcError("GGUF export needs a fast (tokenizers) tokenizer")
    spec = json.loads(backend.to_str())
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or model.get("byte_fallback") or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise OptcError(
            f"GGUF export writes byte-level BPE tokenizers only; this one is {model.get('type')} "
            f"with decoder {(spec.get('decoder') or {}).get('type')}"
        )
    vocab: dict[str, int] = dict(model["vocab"])
    types = {i: 1 for i in vocab.values()}  # NORMAL
    for added in spec.get("added_tokens") or []:
        vocab[added["content"]] = added["id"]
        types[added["id"]] = 3 if added.get("special") else 4  # CONTROL / USER_DEFINED
    size = max(vocab.values()) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    token_types = [5] * size  # UNUSED, for ids no token claims
    for text, i in vocab.items():
        tokens[i], token_types[i] = text, types[i]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    meta = {
        "model": "gpt2",
        # A GGUF source's own name first: its family's rules (e.g. ``smollm`` splits digits) are
        # lost in transformers' byte-level conversion.
        "pre": (getattr(tokenizer, "init_kwargs", None) or {}).get(GGUF_PRE_TOKENIZER_KEY)
        or _pre_tokenizer_name(spec.get("pre_tokenizer")),
        "tokens": tokens,
        "token_type": token_types,
        "merges": merges,
        "add_bos_token": bool(getattr(tokenizer, "add_bos_token", False)),
    }
    for key, attr in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                      ("unknown_token_id", "unk_token_id"), ("padding_token_id", "pad_token_id")):
        value = getattr(tokenizer, attr, None)
        if value is not None:
            meta[key] = int(value)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        meta["chat_template"] = template
    return meta


def _add_tokenizer(writer, meta: dict) -> None:
    writer.add_tokenizer_model(meta["model"])
    writer.add_tokenizer_pre(meta["pre"])
    writer.add_token_list(meta["tokens"])
    writer.add_token_types(meta["token_type"])
    writer.add_token_merges(meta["merges"])
    writer.add_add_bos_token(meta["add_bos_token"])
    for key, add in (("bos_token_id", writer.add_bos_token_id), ("eos_token_id", writer.add_eos_token_id),
                     ("unknown_token_id", writer.add_unk_token_id), ("padding_token_id", writer.add_pad_token_id)):
        if key in meta:
            add(meta[key])
    if "chat_template" in meta:
        writer.add_chat_template(meta["chat_template"])


# --- writer -----------------------------------------------------------------------------------


def _rope_theta(config) -> float:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        raise OptcError(f"GGUF export writes plain RoPE only; this model uses rope_type {rope_type!r}")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise OptcError("the model config has no rope_theta")
    return float(theta)


def _add_hparams(writer, config) -> int:
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(_rope_theta(config))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    return head_dim


def check_gguf_model(src: ExportSource) -> tuple[str, bool]:
    """GGUF architecture and q/k permutation of ``src``'s model, or a refusal with the reason."""
    mt = getattr(src.config, "model_type", None)
    if mt not in ARCHITECTURES:
        raise OptcError(
            f"GGUF export supports Llama-family models ({', '.join(ARCHITECTURES)}); this is {mt!r}"
        )
    return ARCHITECTURES[mt]


def _name_map(src: ExportSource, arch: str):
    import gguf

    arch_id = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    return gguf.get_tensor_name_map(arch_id, src.config.num_hidden_layers)


def _tied(src: ExportSource) -> bool:
    return src.head is not None and bool(getattr(src.config, "tie_word_embeddings", False))


def _type_of_grid(src: ExportSource, mod: str) -> str:
    """The GGUF type of a decoder Linear in a ``PER_SCHEME`` file: the one that holds its grid."""
    p = src.qparams.get(mod)
    t = scheme_type(None if p is None else p.scheme)
    if t is None:
        raise OptcError(f"GGUF stores {mod}'s {p.scheme.label()} in no block type ({SCHEME_TYPES_HELP})")
    return t


def tensor_types(src: ExportSource, qtype: str, embedding_bits: int = 16) -> dict[str, TensorType]:
    """The GGUF type of every matrix ``src`` stores (state-dict key -> type): ``qtype`` for each
    decoder Linear (with ``PER_SCHEME``, the type that holds its own grid), float16 (Q8_0 with ``embedding_bits=8``) for the embeddings, when ``qtype`` is
    one block type; llama.cpp's rules for every tensor when it names a mix (``MIXES``)."""
    import gguf

    arch, _ = check_gguf_model(src)
    name_map = _name_map(src, arch)
    tied = _tied(src)
    embd = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.TOKEN_EMBD]
    keys = [k for k in src.keys() if k.endswith(".weight") and len(src.spec(k)[1]) == 2
            and not (tied and k.rpartition(".")[0] == src.head)]
    base = {k: name_map.get_name(k.rpartition(".")[0]) for k in keys}
    missing = next((k for k, b in base.items() if b is None), None)
    if missing is not None:
        raise OptcError(f"GGUF export has no llama.cpp name for {missing}")
    cols = {k: src.spec(k)[1][1] for k in keys}
    if qtype in MIXES:
        config = src.config
        heads = config.num_attention_heads
        types = mix_types(qtype, [(f"{base[k]}.weight", cols[k]) for k in keys], tied=tied, n_head=heads,
                          n_head_kv=getattr(config, "num_key_value_heads", None) or heads,
                          n_layer=config.num_hidden_layers)
        out = {k: types[f"{base[k]}.weight"] for k in keys}
    else:
        linears = set(src.linears()) - {src.head}
        out = {}
        for k in keys:
            mod = k.rpartition(".")[0]
            if mod in linears:
                out[k] = TensorType(qtype if qtype != PER_SCHEME else _type_of_grid(src, mod))
            elif base[k] == embd and embedding_bits == 8:
                out[k] = TensorType("q8_0")
            else:
                out[k] = TensorType("f16")
    for k, t in out.items():
        if t.wanted is None and t.qtype != "f16" and cols[k] % BLOCK_OF[t.qtype]:
            what = f"{k.rpartition('.')[0]} has K={cols[k]}" if base[k] != embd else f"{k} has {cols[k]} columns"
            raise OptcError(f"{t.qtype.upper()} stores rows in {BLOCK_OF[t.qtype]}-weight blocks; {what}")
    if embedding_bits == 8 and qtype in MIXES:
        key = next((k for k in keys if base[k] == embd), None)
        if key is not None:
            out[key] = TensorType("q8_0")
    return out


def plan_gguf(src: ExportSource, qtype: str, requantize: bool = False,
              embedding_bits: int = 16) -> dict[str, tuple[TensorType, str]]:
    """Type and storage of every matrix (state-dict key -> (type, how)): ``exact`` (an optc grid
    the type holds), ``rounded`` (float weights, quantized here), ``requantized`` (an optc grid the
    type cannot hold, quantized again) or ``float``. For one block type a misfit is refused unless
    ``requantize``; a mix re-quantizes what its types cannot hold, and says which."""
    qtype = check_qtype(qtype)
    plan: dict[str, tuple[TensorType, str]] = {}
    misfits: dict[str, str] = {}
    for key, t in tensor_types(src, qtype, embedding_bits).items():
        mod = key.rpartition(".")[0]
        if t.qtype == "f16":
            plan[key] = (t, "float")
        elif mod not in src.qparams:
            plan[key] = (t, "rounded")
        elif (reason := block_fit(src.qparams[mod], t.qtype)) is None:
            plan[key] = (t, "exact")
        else:
            plan[key] = (t, "requantized")
            misfits[mod] = reason
    if misfits and not requantize and qtype not in MIXES:
        name, reason = next(iter(misfits.items()))
        raise OptcError(
            f"GGUF {qtype.upper()} cannot hold {name}'s grid exactly ({reason}; {len(misfits)} module(s)); "
            "pass requantize to round the dequantized weights again with llama.cpp's quantizer"
        )
    for name, reason in misfits.items():
        log.warning("%s: re-quantized to %s (%s)", name, plan[f"{name}.weight"][0].qtype.upper(), reason)
    return plan


def write_gguf_source(src: ExportSource, path: Path, qtype: str, *, requantize: bool = False,
                      embedding_bits: int = 16, imatrix: Imatrix | None = None) -> dict:
    """Write ``src`` as one GGUF file of type ``qtype`` (a block type of ``GGUF_TYPES`` or a mix of
    ``MIXES``), its tokenizer inside.

    Matrices with an optc grid that fits their type are stored exactly; float ones are quantized
    (gguf's reference round-to-nearest for the 32-weight types, optc's k-quant solver for the
    k-quants); a grid that does not fit is refused unless ``requantize`` (mixes re-quantize it
    and say so). With one block type the embeddings and an untied output head stay float16 (the
    input embedding Q8_0 with ``embedding_bits=8``); a mix types them as llama.cpp does. Norms
    are float32. ``imatrix`` (llama.cpp's importance matrix, checked against the model) weighs the
    rounding of every matrix quantized here: the k-quant solver's, and for the 32-weight types the
    same weighted least-squares search per block instead of plain round-to-nearest.
    """
    import gguf
    import torch

    qtype = check_qtype(qtype)
    arch, permute = check_gguf_model(src)
    plan = plan_gguf(src, qtype, requantize, embedding_bits)
    meta = tokenizer_metadata(src.tokenizer)
    config = src.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    name_map = _name_map(src, arch)
    if imatrix is not None:
        linears = set(src.linears()) - {src.head}
        check_imatrix(imatrix, {f"{name_map.get_name(k.rpartition('.')[0])}.weight": src.spec(k)[1][1]
                                for k, (_, how) in plan.items()
                                if k.rpartition(".")[0] in linears and how in ("rounded", "requantized")})
    path = Path(path)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(str(getattr(config, "_name_or_path", "") or "optc model"))
    _add_hparams(writer, config)
    writer.add_file_type(_file_type_of(qtype))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    exact = [k.rpartition(".")[0] for k, (_, how) in plan.items() if how == "exact"]
    writer.add_string("optc.version", optc.__version__)
    if exact:
        schemes = sorted({src.qparams[n].scheme.label() for n in exact})
        writer.add_string("optc.scheme", ", ".join(schemes))
    writer.add_uint32("optc.exact_modules", len(exact))
    _add_tokenizer(writer, meta)

    tied = _tied(src)
    written = 0
    with torch.no_grad():
        for key in src.keys():
            mod, _, leaf = key.rpartition(".")
            if tied and mod == src.head:
                continue  # absent output.weight tells loaders the head is tied
            base = name_map.get_name(mod)
            if base is None:
                raise OptcError(f"GGUF export has no llama.cpp name for {key}")
            rows = heads if mod.endswith("q_proj") else kv_heads if mod.endswith("k_proj") else 0
            t, how = plan.get(key, (None, None))
            gname = f"{base}.{leaf}"
            imp = imatrix.importance(gname) if imatrix is not None and gname in imatrix.sums else None
            data, raw = _tensor_data(src.tensor(key), how, t, src.qparams.get(mod), mod, imp)
            if permute and rows:
                data = permute_rotary_rows(data, rows)
            writer.add_tensor(f"{base}.{leaf}", data, raw_dtype=raw)
            written += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    linears = set(src.linears()) - {src.head}
    hows = {k.rpartition(".")[0]: how for k, (_, how) in plan.items() if k.rpartition(".")[0] in linears}
    counts = {how: sum(1 for h in hows.values() if h == how) for how in sorted(set(hows.values()))}
    types: dict[str, int] = {}
    for t, _ in plan.values():
        types[t.qtype] = types.get(t.qtype, 0) + 1
    summary = {
        "format": f"gguf/{qtype}",
        "file": path.name,
        "bytes": path.stat().st_size,
        "tensors": written,
        "modules": counts,
        "types": dict(sorted(types.items())),
        "requantized": sorted(n for n, h in hows.items() if h == "requantized"),
        "rounded": sorted(n for n, h in hows.items() if h == "rounded"),
        # llama.cpp's fallback: a type whose blocks do not divide the rows, replaced.
        "fallbacks": {f"{name_map.get_name(k.rpartition('.')[0])}.weight": f"{t.wanted} -> {t.qtype}"
                      for k, (t, _) in plan.items() if t.wanted is not None},
    }
    if summary["fallbacks"]:
        log.info("gguf %s: %d tensor(s) fell back to a type their rows hold: %s", qtype, len(summary["fallbacks"]),
                 ", ".join(f"{n} ({v})" for n, v in summary["fallbacks"].items()))
    log.info("gguf %s: %s, %d bytes in %s", qtype, counts, summary["bytes"], path)
    return summary


def write_gguf(
    model: torch.nn.Module,
    tokenizer,
    path: Path,
    qtype: str,
    qparams: dict[str, QuantParams] | None = None,
    *,
    requantize: bool = False,
    embedding_bits: int = 16,
) -> dict:
    """:func:`write_gguf_source` of a model in memory."""
    return write_gguf_source(ModelSource(model, tokenizer, qparams or {}), path, qtype, requantize=requantize,
                             embedding_bits=embedding_bits)


def _tensor_data(t: torch.Tensor, how: str | None, tt: TensorType | None, p: QuantParams | None, name: str = "",
                 importance: torch.Tensor | None = None):
    """Array to write for one state-dict tensor and its raw GGML type (None: from the array dtype)."""
    import gguf
    import numpy as np

    from optc.compress.kquant import K_TYPES, block32_quant, kquant

    if how in ("exact", "rounded", "requantized"):
        kind = _ggml_type(tt.qtype)
        if how == "exact" and tt.qtype in K_TYPES:
            return encode_kblocks(kblock_codes(t, p, tt.qtype, name)), kind
        if how == "exact":
            return encode_blocks(*block_codes(t, p, tt.qtype, name), tt.qtype), kind
        if tt.qtype in K_TYPES:
            return encode_kblocks(kquant(t.detach().float(), tt.qtype, importance)), kind
        if importance is not None:  # the importance-weighted least-squares search, per 32-weight block
            bt = GGUF_TYPES[tt.qtype]
            return encode_blocks(*block32_quant(t.detach().float(), bt.bits, bt.with_min, importance), tt.qtype), kind
        return gguf.quants.quantize(t.detach().float().cpu().numpy(), kind), kind
    w = t.detach().float().cpu().numpy()
    # Norms and biases stay float32 (llama.cpp keeps 1-D tensors so); matrices float16.
    return (w if t.dim() == 1 else w.astype(np.float16)), None


# --- reading what a file holds (optc inspect) -------------------------------------------------

_GGUF_BITS = {"F32": 32, "F16": 16, "BF16": 16, "Q8_0": 8, "Q4_0": 4, "Q4_1": 4, "Q5_0": 5, "Q5_1": 5,
              "Q2_K": 2, "Q3_K": 3, "Q4_K": 4, "Q5_K": 5, "Q6_K": 6, "IQ4_NL": 4}


_GGUF_GROUP = {"Q4_0": 32, "Q4_1": 32, "Q5_0": 32, "Q5_1": 32, "Q8_0": 32, "IQ4_NL": 32,
               "Q2_K": 16, "Q3_K": 16, "Q4_K": 32, "Q5_K": 32, "Q6_K": 16}


def gguf_file(path: Path) -> Path | None:
    """The GGUF file ``path`` names: a ``.gguf`` file, or a directory optc exported as GGUF (one
    ``.gguf`` file and no config.json)."""
    path = Path(path).expanduser()
    if path.is_file():
        return path if path.suffix == ".gguf" else None
    if path.is_dir() and not (path / "config.json").exists():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None


def describe_gguf(path: Path) -> dict:
    """Architecture, block types, parameters and sparsity of a GGUF file."""
    from gguf import dequantize

    path = gguf_file(path) or Path(path)
    try:
        index = read_gguf_index(path)
    except (OSError, ValueError) as exc:
        raise OptcError(f"cannot read GGUF file {path}: {exc}") from None

    types: dict[str, int] = {}
    params = zeros = linear_params = tensor_bytes = 0
    block_types: set[str] = set()
    for t in index.tensors:
        name = t.type_name
        types[name] = types.get(name, 0) + 1
        params += int(t.n_elements)
        tensor_bytes += int(t.n_bytes)
        if len(t.shape) > 1 and t.name.startswith("blk."):
            block_types.add(name)
            try:
                zeros += int((dequantize(index.data(t), t.qtype) == 0).sum())
            except (NotImplementedError, ValueError) as exc:
                raise OptcError(f"cannot read tensor {t.name} of GGUF file {path}: {exc}") from None
            linear_params += int(t.n_elements)
    size = path.stat().st_size
    info = {
        "path": str(path),
        "architecture": index.string("general.architecture") or "?",
        "format": "gguf",
        "scheme": "+".join(sorted(block_types)) or "-",
        "tensor_types": types,
        # The decoder matrices' types: what the file's quantization is.
        "bits": sorted({_GGUF_BITS.get(n, n) for n in block_types}, key=str),
        # Weights per scale: 32 for the legacy blocks, the k-quants' sub-blocks (ggml-common.h).
        "group_size": sorted({_GGUF_GROUP[n] for n in block_types if n in _GGUF_GROUP}),
        # As llama.cpp's loader prints it: tensor bytes * 8 / parameters, norms included.
        "bits_per_weight": round(8 * tensor_bytes / max(1, params), 3),
        "symmetric": sorted({n in ("Q4_0", "Q5_0", "Q8_0") for n in block_types if n.startswith("Q")}),
        "act_order": ["False"],
    }
    scheme = index.string("optc.scheme")
    if scheme is not None:
        info["optc_scheme"] = scheme
        info["optc_exact_modules"] = int(index.fields.get("optc.exact_modules", 0))
    info.update({"parameters": params, "sparsity": round(zeros / linear_params, 4) if linear_params else 0.0,
                 "bytes": size, "ratio_to_fp16": round(size / max(1, 2 * params), 4)})
    return info


@functools.lru_cache(maxsize=32)
def _file_type(path: str, mtime_ns: int, size: int) -> int | None:
    """``general.file_type`` of a GGUF file, or None when it cannot be read (cached per file state)."""
    try:
        field = read_gguf_index(path).fields.get("general.file_type")
    except (OSError, ValueError):
        return None
    return int(field) if isinstance(field, int) else None


def _detect(qtype: str, path: Path) -> bool:
    """A GGUF file of this type; a file of a type optc does not write (or unreadable) is claimed
    by the first GGUF entry, since optc reads and describes every GGUF the same way."""
    found = gguf_file(path)
    if found is None:
        return False
    stat = found.stat()
    file_type = _file_type(str(found), stat.st_mtime_ns, stat.st_size)
    if file_type == _file_type_of(qtype):
        return True
    known = {bt.file_type for bt in GGUF_TYPES.values()} | {m.file_type for m in MIXES.values()} | {FILE_TYPE_GUESSED}
    return qtype == next(iter(GGUF_TYPES)) and file_type not in known


def _file_type_of(qtype: str) -> int:
    if qtype == PER_SCHEME:
        return FILE_TYPE_GUESSED
    return MIXES[qtype].file_type if qtype in MIXES else GGUF_TYPES[qtype].file_type


# --- the registry entries ---------------------------------------------------------------------

def _fits(qtype: str, scheme: QuantScheme | None, permuted: bool) -> str | None:
    if qtype in MIXES:
        # A mix types each tensor itself and re-quantizes grids its types cannot hold.
        if scheme is None or scheme.kquant_kind is not None:
            return None
        return integer_grid(scheme, f"GGUF {qtype.upper()}")
    if scheme is None or GGUF_TYPES[qtype].bits is None:
        return None
    if refusal := integer_grid(scheme, f"GGUF {qtype.upper()}"):
        return refusal
    if reason := _levels_misfit(scheme, qtype):
        return reason
    if scheme.group_size is not None and scheme.group_size % BLOCK:
        return f"groups of {scheme.group_size} split {qtype.upper()}'s {BLOCK}-weight blocks"
    if permuted:
        return f"act-order (permuted) groups split {qtype.upper()}'s blocks"
    return None


def _bits_per_weight(qtype: str, scheme: QuantScheme | None, in_features: int) -> float | None:
    if scheme is None:
        return None
    if qtype in MIXES:  # the mix's base type, or the type its fallback stores rows of this length in
        t = MIXES[qtype].base if in_features % BLOCK_OF[MIXES[qtype].base] == 0 else FALLBACK[MIXES[qtype].base]
        return GGUF_STORED_BITS[t]
    group = scheme.group_size or in_features
    # An upper bound: the block scales are inside the bits, and a scale and zero per group on top.
    return GGUF_TYPES[qtype].stored_bits + 64 * math.ceil(in_features / group) / in_features


# The optc grid each GGUF type holds exactly: legacy blocks' plain grids, the k-quants' two-level
# scales (and offsets).
TYPE_SCHEMES = {
    "q4_0": (4, True, 32, None), "q4_1": (4, False, 32, None), "q5_0": (5, True, 32, None),
    "q5_1": (5, False, 32, None), "q8_0": (8, True, 32, None), "q2_k": (2, False, 16, "k-quant"),
    "q3_k": (3, True, 16, "k-quant"), "q4_k": (4, False, 32, "k-quant"), "q5_k": (5, False, 32, "k-quant"),
    "q6_k": (6, True, 16, "k-quant"),
}


def scheme_type(scheme: QuantScheme | None) -> str | None:
    """The cheapest GGUF type that holds ``scheme``'s grid exactly (``f16`` for a float Linear),
    or None."""
    if scheme is None:
        return "f16"

    def holds(bits: int, symmetric: bool, group: int, fmt: str | None) -> bool:
        if scheme.type != "int" or scheme.group_size != group or (scheme.scale_format or None) != fmt:
            return False
        if fmt is not None:  # a k-quant holds its own grid
            return (scheme.bits, scheme.symmetric) == (bits, symmetric)
        # A centred block holds symmetric grids of up to its bits, a block with a min any grid.
        return scheme.bits <= bits and (scheme.symmetric or not symmetric)

    fits = [t for t, spec in TYPE_SCHEMES.items() if holds(*spec)]
    return min(fits, key=GGUF_STORED_BITS.__getitem__, default=None)


SCHEME_TYPES_HELP = ("it holds int4 and int5 grids of 32-weight groups, symmetric (Q4_0, Q5_0) or not (Q4_1, "
                     "Q5_1), int8 symmetric g32 (Q8_0) and the k-quant grids Q2_K to Q6_K")


def _scheme_fits(scheme: QuantScheme | None, permuted: bool) -> str | None:
    if scheme is None:
        return None
    if scheme_type(scheme) is None:
        return f"GGUF stores {scheme.label()} in no block type: {SCHEME_TYPES_HELP}"
    if permuted:
        return "act-order (permuted) groups split GGUF's blocks"
    return None


def _scheme_bits_per_weight(scheme: QuantScheme | None, in_features: int) -> float | None:
    t = scheme_type(scheme)
    return None if scheme is None or t is None else GGUF_STORED_BITS[t]


def _scheme_stored_bits(scheme: QuantScheme | None, out_features: int, in_features: int, float_bits: int,
                        permuted: bool = False) -> int | None:
    """Bits of one Linear's tensor in the type that holds its grid (float Linears: float16); None
    when that type's blocks do not divide its rows (the k-quants' 256 weights)."""
    t = scheme_type(scheme)
    if t is None or in_features % BLOCK_OF[t]:
        return None
    return round(out_features * in_features * GGUF_STORED_BITS[t])


def _mix_schemes(mix: str, model) -> dict[str, QuantScheme | None]:
    """Each decoder Linear of ``model`` -> the grid of its type in ``mix`` (None: stored float16)."""
    from optc.compress.schemes import QuantScheme

    src = ModelSource(model)
    linears = set(src.linears()) - {src.head}
    out: dict[str, QuantScheme | None] = {}
    for key, t in tensor_types(src, mix).items():
        mod = key.rpartition(".")[0]
        if mod in linears:
            spec = TYPE_SCHEMES.get(t.qtype)
            out[mod] = None if spec is None else QuantScheme(bits=spec[0], symmetric=spec[1], group_size=spec[2],
                                                             scale_format=spec[3])
    return out


def _write(qtype: str, src: ExportSource, directory: Path, *, max_shard_bytes: int | None = None,
           requantize: bool = False, embedding_bits: int = 16, imatrix: Path | None = None) -> dict:
    refuse_activations(src, "gguf" if qtype == PER_SCHEME else f"gguf-{qtype}")
    name = "model.gguf" if qtype == PER_SCHEME else f"model-{qtype}.gguf"
    return write_gguf_source(src, Path(directory) / name, qtype, requantize=requantize,
                             embedding_bits=embedding_bits, imatrix=None if imatrix is None else read_imatrix(imatrix))


_DESCRIPTIONS = {
    "q4_0": "one GGUF file of Q4_0 blocks (symmetric 4-bit grids in 32-weight blocks kept exactly), loaded by llama.cpp",
    "q4_1": "one GGUF file of Q4_1 blocks (4-bit grids with a min per 32 weights; codes kept exactly), loaded by llama.cpp",
    "q5_0": "one GGUF file of Q5_0 blocks (symmetric 5-bit grids in 32-weight blocks kept exactly), loaded by llama.cpp",
    "q5_1": "one GGUF file of Q5_1 blocks (5-bit grids with a min per 32 weights; codes kept exactly), loaded by llama.cpp",
    "q8_0": "one GGUF file of Q8_0 blocks (8-bit grids in 32-weight blocks kept exactly), loaded by llama.cpp",
    "f16": "one GGUF file of float16 weights, loaded by llama.cpp",
    **{mix: f"one GGUF file typed tensor by tensor as llama.cpp's {mix.upper()} mix (k-quants, their fallbacks "
            "for rows that are not whole super-blocks), loaded by llama.cpp" for mix in MIXES},
}

_USAGE = """llama.cpp:

```sh
llama-cli -m {path}/{file} -p "The capital of France is"
```

transformers (dequantizes to float on load):

```python
from transformers import AutoModelForCausalLM, AutoTokenizer

model = AutoModelForCausalLM.from_pretrained("{path}", gguf_file="{file}")
tokenizer = AutoTokenizer.from_pretrained("{path}", gguf_file="{file}")
```
"""

GGUF_FORMATS = tuple(
    Format(
        name=f"gguf-{qtype}",
        description=_DESCRIPTIONS[qtype],
        fits=functools.partial(_fits, qtype),
        write=functools.partial(_write, qtype),
        read=None,  # transformers' GGUF loader (optc.model.load)
        detect=functools.partial(_detect, qtype),
        describe=describe_gguf,
        bits_per_weight=functools.partial(_bits_per_weight, qtype),
        usage=_USAGE,
        embedding_8bit=None,
        linear_schemes=functools.partial(_mix_schemes, qtype) if qtype in MIXES else None,
        takes_imatrix=True,
    )
    for qtype in [*GGUF_TYPES, *MIXES]
) + (
    Format(
        name="gguf",
        description="one GGUF file, each decoder Linear in the block type that holds its own grid (a budget's "
                    "mix: Q4_0/Q4_1/Q5_0/Q5_1/Q8_0, k-quants, F16), loaded by llama.cpp",
        fits=_scheme_fits,
        write=functools.partial(_write, PER_SCHEME),
        read=None,
        detect=functools.partial(_detect, PER_SCHEME),
        describe=describe_gguf,
        bits_per_weight=_scheme_bits_per_weight,
        stored_bits=_scheme_stored_bits,
        usage=_USAGE,
        embedding_8bit=None,
        takes_imatrix=True,
    ),
)
