"""Builds a model on its device and fills it from a Hugging Face directory's
safetensors files (or with random values, `load_format="dummy"`, for benchmarks)."""

from __future__ import annotations

import glob
import os
from contextlib import ExitStack

import torch
from tqdm import tqdm

from ..architectures import ARCHITECTURES
from ..base.tp import TPGroup
from ..config import EngineConfig
from ..default_model import default_model_path, is_default_model
from ..fp8 import WeightQuant, dequantize
from ..models.protocol import CausalLM


def build_on_meta(config: EngineConfig, tp: TPGroup | None = None) -> CausalLM:
    """This rank's model of `config` on the meta device: its parameters' shapes, no memory."""
    mc = config.model_config
    with torch.device("meta"):
        cls = ARCHITECTURES[mc.architecture].model_class()
        return cls(mc, config.max_model_len, config.use_triton, fused=config.fused_ops, tp=tp or TPGroup())


def resolve_model_path(model: str | None) -> str:
    if model is None:
        return default_model_path()
    path = os.path.expanduser(model)
    if not os.path.isdir(path) and is_default_model(path):
        return default_model_path()  # resolved on another host: this host's own copy
    if not os.path.isdir(path):
        raise ValueError(f"model path {model!r} does not exist or is not a directory "
                         "(pdserve loads local Hugging Face directories only)")
    return path


def load_model(config: EngineConfig, load_format: str = "auto", tp: TPGroup | None = None) -> CausalLM:
    """This rank's shard of the model (the whole model without a group)."""
    mc = config.model_config
    tp = tp or TPGroup()
    device, dtype = config.torch_device, config.torch_dtype
    model = build_on_meta(config, tp)
    rope = model.rotary.cos, model.rotary.sin  # float32 host tables (allocating below wipes buffers)
    # cast on meta (free) so that the real allocation is already in the model's dtype: a
    # float32 staging copy would need twice a bf16 model's memory (141 GB per GPU for 70B at TP 2)
    # allocated with torch.empty, not Module.to_empty: its empty_like from meta runs through torch's
    # Python references and imports sympy, 0.5 s of CPU in every worker process that loads a model
    model = model.to(dtype=dtype)._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if mc.tie_word_embeddings and tp.size == 1:  # allocating from meta makes new Parameters: tie again
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.cos, model.rotary.sin = (t.to(device) for t in rope)
    params = dict(model.named_parameters())
    keep = model.float32_params()  # e.g. DeepSeek's routers
    for name, p in params.items():
        want = torch.float32 if name in keep else dtype
        if p.dtype != want:
            p.data = p.data.to(want)
    if tp.size > 1:
        model.lm_head.weight.data.zero_()  # the last rank's padding rows: logits cut after the gather
    if load_format == "dummy":
        gen = torch.Generator(device=device).manual_seed(config.seed + 7919 * tp.rank)
        for p in model.parameters():
            p.data.uniform_(-0.02, 0.02, generator=gen)
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.data.fill_(1.0)
        return model.eval()
    if load_format != "auto":
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    _load_safetensors(model, config.model, params)
    return model.eval()


def _dequantized(hf_name: str, part, where: dict, quant: WeightQuant | None, path: str) -> torch.Tensor:
    """An FP8 checkpoint tensor, whole, times its block scales (float32; the caller casts)."""
    if quant is None:
        raise ValueError(f"tensor {hf_name!r} of {path!r} is FP8 ({part.get_dtype()}) but config.json has no "
                         "quantization_config: its scales are unknown")
    scale = quant.scale_name(hf_name)
    if scale not in where:
        raise ValueError(f"FP8 tensor {hf_name!r} of {path!r} has no {scale!r} beside it")
    return dequantize(part[:], where[scale].get_tensor(scale), quant.block, torch.float32, hf_name)


def _load_safetensors(model: CausalLM, path: str, params: dict) -> None:
    """Reads only this rank's slices of each tensor (safetensors' lazy slices); an FP8 weight of a
    block-scaled checkpoint (engine/fp8.py) is read whole with its scales, dequantized to its
    parameter's dtype, then sliced."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"model path {path!r} has no *.safetensors files")
    quant = model.cfg.weight_quant
    loaded: dict[str, int] = {}
    with torch.no_grad(), ExitStack() as stack:
        handles = [stack.enter_context(safe_open(file, framework="pt")) for file in files]
        where = {name: f for f in handles for name in f.keys()}  # a scale may sit in another file
        for file, f in tqdm(zip(files, handles), desc="loading weights", unit="file", total=len(files),
                            disable=len(files) < 2):
            for hf_name in f.keys():
                if quant is not None and quant.is_scale(hf_name):
                    continue  # read with its weight
                part, whole = f.get_slice(hf_name), None
                if part.get_dtype().startswith("F8"):
                    whole = _dequantized(hf_name, part, where, quant, path)
                for target, rows, dim, src in model.shard_targets(hf_name):
                    name, _, index = target.partition("[")  # "w_down[3]": expert 3 of a fused tensor
                    if name not in params:
                        raise ValueError(f"unexpected tensor {hf_name!r} in {file}")
                    p = params[name].data
                    if index:
                        p = p[int(index.rstrip("]"))]
                    src_of = part if whole is None else whole
                    t = src_of[:] if src is None else (src_of[src] if dim == 0 else src_of[:, src])
                    dst = p if rows is None else p[rows]
                    if dst.shape != t.shape:
                        raise ValueError(f"tensor {hf_name!r} gives {tuple(t.shape)} to {name} here, "
                                         f"expected {tuple(dst.shape)} (checkpoint shape "
                                         f"{tuple(part.get_shape())})")
                    dst.copy_(t)  # a dequantized weight: float32 rounded once to the parameter's dtype
                    loaded[name] = loaded.get(name, 0) + t.numel()
    for name, p in params.items():
        if name == "lm_head.weight" and model.cfg.tie_word_embeddings and model.tp.size == 1:
            continue
        if loaded.get(name, 0) != model.expected_elements(name, p):
            raise ValueError(f"checkpoint at {path!r} is missing weights for {name}")
