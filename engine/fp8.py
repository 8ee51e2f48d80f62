"""FP8 block-scaled checkpoints (DeepSeek-V3/R1, the Qwen3 `-FP8` releases): what their
`quantization_config` says and how their weights become the model's.

Such a checkpoint stores each quantized linear weight W [out, in] as float8_e4m3fn values `q`
beside `<name>.weight_scale_inv` [ceil(out/bo), ceil(in/bi)] (float32), one scale per (bo, bi)
block (`weight_block_size`, [128, 128] in every release): W = q * scale_inv, block by block.
Embeddings, norms, routers and the LM head stay in the checkpoint's dtype.

Lifecycle: `ModelConfig.from_dir` reads the config through `weight_quant_of` (refusing other
quantization methods by name); the loader (exec/loader.py) decides per linear layer:
  held in FP8  where the model runs its Triton kernels (fused_ops: a GPU's default, the CPU
               interpreter on request; exec/loader.holds_fp8), each decoder Linear / RowParallelLinear
               whose every source is FP8 and cut on block bounds keeps the e4m3 values and their scales as they
               are (models/layers.hold_fp8) and runs ops/triton_fp8.fp8_linear
  dequantized  everything else (the experts' fused tensors, MLA's kv_b_proj, a cut inside a block,
               any other device): `dequantize` gives the model's dtype before the rank's slice
Tensor parallelism, the KV tiers and the handoff see an ordinary model either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCALE_SUFFIX = "_scale_inv"  # "<layer>.weight" -> "<layer>.weight_scale_inv"


@dataclass(frozen=True)
class WeightQuant:
    """An FP8 checkpoint's weight format: e4m3 values, one float32 scale per `block` (rows, cols)."""

    block: tuple[int, int] = (128, 128)

    @staticmethod
    def scale_name(weight_name: str) -> str:
        return weight_name + SCALE_SUFFIX

    @staticmethod
    def is_scale(name: str) -> bool:
        return name.endswith(SCALE_SUFFIX)


def weight_quant_of(quant: dict | None, path: str) -> WeightQuant | None:
    """The checkpoint's `quantization_config` -> its WeightQuant (None: not quantized). Refuses,
    naming `quant_method`, what pdserve cannot load: other methods, per-tensor FP8, other formats."""
    if not quant:
        return None
    method = quant.get("quant_method")
    where = f"model at {path!r}: quantization_config quant_method {method!r}"
    if method != "fp8":
        raise ValueError(f"{where} is not supported: pdserve loads bf16/fp16/fp32 weights and FP8 checkpoints "
                         "with block scales (quant_method 'fp8' with weight_block_size, e.g. DeepSeek-V3, "
                         "Qwen3-*-FP8); convert the checkpoint to bf16 first")
    block = quant.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise ValueError(f"{where} without weight_block_size [rows, cols] (per-tensor FP8) is not supported: "
                         "pdserve loads FP8 checkpoints with block scales")
    if quant.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{where} with fmt {quant.get('fmt')!r} is not supported: e4m3 values only")
    if quant.get("scale_fmt") not in (None, "float32", "fp32"):
        raise ValueError(f"{where} with scale_fmt {quant.get('scale_fmt')!r} is not supported: float32 scales only")
    return WeightQuant(block=(block[0], block[1]))


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], dtype: torch.dtype,
               name: str = "weight") -> torch.Tensor:
    """FP8 values [..., rows, cols] times their block scales [..., ceil(rows/br), ceil(cols/bc)]
    -> `dtype`, computed in float32 (Hugging Face's dequantization rounds the same way). A last
    partial block takes its block's scale."""
    br, bc = block
    rows, cols = q.shape[-2:]
    want = (-(-rows // br), -(-cols // bc))
    if tuple(scale_inv.shape[-2:]) != want:
        raise ValueError(f"{name}: scales {tuple(scale_inv.shape)} do not match the weight {tuple(q.shape)} "
                         f"in blocks of {br}x{bc} (expected {want})")
    s = scale_inv.float().repeat_interleave(br, dim=-2)[..., :rows, :].repeat_interleave(bc, dim=-1)[..., :cols]
    return (q.float() * s).to(dtype)
