"""`make test-interop`, vLLM venv: the rounding of vLLM's CPU W4A16 kernel itself, no checkpoint.

Random 4-bit symmetric codes (``uint4b8``, groups of 64) and scales are packed the way vLLM's
``CPUWNA16LinearKernel`` packs a GPTQ / compressed-tensors weight after loading, then multiplied
with ``cpu_gemm_wna16`` and compared with the exact product of the same dequantized weights.
For each activation dtype it prints the kernel's relative error, its systematic gain
(``<out, ref> / <ref, ref> - 1``: 0 for unbiased rounding) and the same two numbers for a dense
matmul of the weights rounded to that dtype; reading back the weights (``x = I``) shows whether
the dequantized values are rounded to nearest or toward zero. Exits non-zero when the float16
kernel is biased (the dtype ``vllm_check.py`` serves in by default).
"""

from __future__ import annotations

import types

import torch
from vllm import _custom_ops as ops
from vllm.model_executor.kernels.linear.mixed_precision.cpu import CPUWNA16LinearKernel
from vllm.model_executor.layers.quantization.utils.quant_utils import pack_quantized_values_into_int32
from vllm.scalar_type import scalar_types


def gain(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out * ref).sum() / (ref * ref).sum()) - 1


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).norm() / ref.norm())


def main() -> None:
    torch.manual_seed(0)
    k, n, g = 576, 576, 64  # a q_proj of the default model
    biased = False
    for dtype in (torch.bfloat16, torch.float16):
        codes = torch.randint(0, 16, (k, n), dtype=torch.int32)  # stored code = q + 8
        scales = (torch.rand(k // g, n) * 0.01 + 0.001).to(dtype)
        layer = torch.nn.Module()
        layer.w = torch.nn.Parameter(pack_quantized_values_into_int32(codes, scalar_types.uint4b8, 0), requires_grad=False)
        layer.s = torch.nn.Parameter(scales, requires_grad=False)
        kernel = types.SimpleNamespace(config=types.SimpleNamespace(weight_type=scalar_types.uint4b8),
                                       w_q_name="w", w_s_name="s")
        CPUWNA16LinearKernel._process_gptq_weights_w4a16(kernel, layer)

        def gemm(x: torch.Tensor) -> torch.Tensor:
            return ops.cpu_gemm_wna16(input=x, q_weight=layer.w, scales=layer.s, zeros=None, bias=None,
                                      pack_factor=8, isa_hint=layer.isa_hint).float()

        W = (codes - 8).float() * scales.float().repeat_interleave(g, 0)  # [K, N], exact
        x = torch.randn(512, k).to(dtype)
        ref = x.float() @ W
        out, dense = gemm(x), (x @ W.to(dtype)).float()
        read = gemm(torch.eye(k, dtype=dtype))
        toward_zero = float((read.abs() <= W.abs()).float().mean())
        name = str(dtype).removeprefix("torch.")
        print(f"{name}: kernel rel error {rel(out, ref):.2e}, gain {gain(out, ref):+.2e} | dense {name} matmul "
              f"rel error {rel(dense, ref):.2e}, gain {gain(dense, ref):+.2e} | weights read back: gain "
              f"{gain(read, W):+.2e}, |w_read| <= |w| for {100 * toward_zero:.1f}% ({layer.isa_hint} kernel)")
        if dtype == torch.float16:
            biased = abs(gain(out, ref)) > 1e-4
    raise SystemExit(1 if biased else 0)


if __name__ == "__main__":
    main()
