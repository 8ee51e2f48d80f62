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
from ..default_model import default_model_path, is_default_model
from ..fp8 import WeightQuant, dequantize
from ..models.protocol import CausalLM
from .runner_settings import RunnerSettings


def build_on_meta(settings: RunnerSettings, tp: TPGroup | None = None) -> CausalLM:
    """This rank's model of `settings` on the meta device: its parameters' shapes, no memory."""
    mc = settings.model_config
    with torch.device("meta"):
        cls = ARCHITECTURES[mc.architecture].model_class()
        return cls(mc, settings.max_model_len, settings.use_triton, fused=settings.fused_ops, tp=tp or TPGroup())


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


def load_model(settings: RunnerSettings, load_format: str = "auto", tp: TPGroup | None = None) -> CausalLM:
    """This rank's shard of the model (the whole model without a group)."""
    mc = settings.model_config
    tp = tp or TPGroup()
    device, dtype = settings.torch_device, settings.torch_dtype
    model = build_on_meta(settings, tp)
    rope = model.rotary.cos, model.rotary.sin  # float32 host tables (allocating below wipes buffers)
    # cast on meta (free) so that the real allocation is already in the model's dtype: a
    # float32 staging copy would need twice a bf16 model's memory (141 GB per GPU for 70B at TP 2)
    # allocated with torch.empty, not Module.to_empty: its empty_like from meta runs through torch's
    # Python references and imports sympy, 0.5 s of CPU in every worker process that loads a model
    model = model.to(dtype=dtype)
    held = _hold_fp8(model, settings, load_format)  # after the cast: a cast would turn e4m3 into the model's dtype
    model = model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=device))
    if mc.tie_word_embeddings and tp.size == 1:  # allocating from meta makes new Parameters: tie again
        model.lm_head.weight = model.embed_tokens.weight
    model.rotary.cos, model.rotary.sin = (t.to(device) for t in rope)
    params = dict(model.named_parameters())
    keep = model.float32_params()  # e.g. DeepSeek's routers
    for name, p in params.items():
        want = torch.float32 if name in keep else dtype
        module, _, leaf = name.rpartition(".")
        if p.dtype != want and not (module in held and leaf.removesuffix("_scale") in FP8_WEIGHTS):
            p.data = p.data.to(want)
    if tp.size > 1:
        model.lm_head.weight.data.zero_()  # the last rank's padding rows: logits cut after the gather
    if load_format == "dummy":
        gen = torch.Generator(device=device).manual_seed(settings.seed + 7919 * tp.rank)
        for name, p in model.named_parameters():
            if p.dtype == torch.float8_e4m3fn:  # values over the e4m3 range, scaled to +-0.02
                p.data.copy_(torch.empty(p.shape, device=device).uniform_(-448, 448, generator=gen))
            elif name.endswith("_scale") and name.rpartition(".")[0] in held:  # a linear's or the experts
                p.data.fill_(0.02 / 448)
            else:
                p.data.uniform_(-0.02, 0.02, generator=gen)
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.data.fill_(1.0)
        return model.eval()
    if load_format != "auto":
        raise ValueError(f"load_format must be auto or dummy, got {load_format!r}")
    _load_safetensors(model, settings.model, params)
    return model.eval()


def holds_fp8(settings: RunnerSettings) -> bool:
    """Whether a model of `settings` keeps an FP8 checkpoint's linear weights and fused experts in
    FP8: wherever it runs its Triton kernels (fused_ops; on CPU through the interpreter)."""
    return settings.model_config.weight_quant is not None and bool(settings.fused_ops)


def _hold_fp8(model: CausalLM, settings: RunnerSettings, load_format: str) -> set[str]:
    """Turns the linear layers that keep their FP8 weights into FP8 ones (models/layers.hold_fp8),
    on meta; returns their module names. A random model (`dummy`) holds every decoder layer's
    Linear and RowParallelLinear; a checkpoint, each whose every source is FP8 and lands on whole
    blocks of scales (a fused or sliced weight whose cut falls inside a block is dequantized)."""
    from ..models.layers import hold_fp8

    if not holds_fp8(settings):
        return set()
    names = fp8_layers(model, settings, load_format)
    for name in names:
        hold_fp8(model.get_submodule(name), settings.model_config.weight_quant.block)
    return names


def fp8_layers(model: CausalLM, settings: RunnerSettings, load_format: str = "auto") -> set[str]:
    """The module names of `model` (built for an FP8 checkpoint's `settings`) that hold FP8 where
    the model runs its Triton kernels: every decoder Linear / RowParallelLinear for a random model
    (`dummy`); a checkpoint's, each whose every source is FP8 and lands on whole blocks of scales.
    (`pdserve plan` counts their bytes as a GPU holds them.)"""
    from ..models.layers import Linear, RowParallelLinear
    from ..models.moe import SparseMoE

    block = settings.model_config.weight_quant.block
    held = {name for name, m in model.named_modules() if name.startswith("layers.") and (
        isinstance(m, (Linear, RowParallelLinear)) or isinstance(m, SparseMoE) and m.can_hold_fp8(block))}
    if load_format == "dummy":
        return held
    return _fp8_layers(model, settings.model, block, held)


FP8_WEIGHTS = ("weight", "w_gate_up", "w_down")  # the parameters a module held in FP8 keeps in e4m3


def _fp8_layers(model: CausalLM, path: str, block: tuple[int, int], modules: set[str]) -> set[str]:
    """The `modules` whose weights the checkpoint's FP8 tensors fill whole, each cut on block
    bounds (read from the safetensors headers only): a linear's weight, or every expert's fused
    gate/up and down (`w_gate_up[e]`: expert e's)."""
    from safetensors import safe_open

    rows_of: dict[str, int] = {}  # module -> rows its FP8 sources fill (an expert's rows counted per expert)
    mixed: set[str] = set()  # modules some source of which is not FP8 or not on block bounds
    for file in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        with safe_open(file, framework="pt") as f:
            for hf_name in f.keys():
                part = f.get_slice(hf_name)
                fp8 = part.get_dtype().startswith("F8")
                shape = tuple(part.get_shape())
                for target, rows, dim, src in model.shard_targets(hf_name):
                    module, _, leaf = target.rpartition(".")
                    leaf = leaf.partition("[")[0]
                    if module not in modules or leaf not in FP8_WEIGHTS:
                        continue
                    n = getattr(model.get_submodule(module), leaf).shape[-2]  # rows of one expert's, or the weight's
                    if not fp8 or not _on_blocks(rows, n, dim, src, shape, block):
                        mixed.add(module)
                        continue
                    rows_of[module] = rows_of.get(module, 0) + (n if rows is None else rows.stop - rows.start)
    return {m for m, r in rows_of.items() if m not in mixed and r == _fp8_rows(model.get_submodule(m))}


def _fp8_rows(module) -> int:
    """The rows a module's FP8 weights have in all (every expert's, for fused experts)."""
    return sum(p.shape[-2] * (p.shape[0] if p.dim() == 3 else 1)
               for name in FP8_WEIGHTS if isinstance(p := getattr(module, name, None), torch.Tensor))


def _on_blocks(rows: slice | None, n: int, dim: int, src: slice | None, shape: tuple, block: tuple[int, int]) -> bool:
    """Whether a source's cut (`src` of its dim `dim`, shape `shape`) and its place in the parameter
    (`rows` of its `n`) fall on block bounds: each starts on one, a part block only at both ends."""
    bn, bk = block
    if dim == 1:  # a column cut (a row-parallel weight): the parameter is the cut, all its rows
        cut = src or slice(0, shape[1])
        return rows is None and cut.start % bk == 0 and ((cut.stop - cut.start) % bk == 0 or cut.stop == shape[1])
    cut, at = src or slice(0, shape[0]), rows or slice(0, n)
    whole = (cut.stop - cut.start) % bn == 0
    return cut.start % bn == 0 and at.start % bn == 0 and (whole or (cut.stop == shape[0] and at.stop == n))


def _dequantized(hf_name: str, part, where: dict, quant: WeightQuant | None, path: str) -> torch.Tensor:
    """An FP8 checkpoint tensor, whole, times its block scales (float32; the caller casts)."""
    if quant is None:
        raise ValueError(f"tensor {hf_name!r} of {path!r} is FP8 ({part.get_dtype()}) but config.json has no "
                         "quantization_config: its scales are unknown")
    scale = quant.scale_name(hf_name)
    if scale not in where:
        raise ValueError(f"FP8 tensor {hf_name!r} of {path!r} has no {scale!r} beside it")
    return dequantize(part[:], where[scale].get_tensor(scale), quant.block, torch.float32, hf_name)


def _copy_fp8(part, where: dict, quant: WeightQuant, hf_name: str, p: torch.Tensor, scale: torch.Tensor,
              rows: slice | None, dim: int, src: slice | None) -> list[tuple[str, int]]:
    """An FP8 tensor's cut into a parameter held in FP8, its block scales into the parameter's
    (the cut on block bounds: _on_blocks). -> [(name suffix, elements filled)]."""
    (bn, bk), shape = quant.block, tuple(part.get_shape())
    q = part[:] if src is None else (part[src] if dim == 0 else part[:, src])
    dst = p if rows is None else p[rows]
    if dst.shape != q.shape:
        raise ValueError(f"tensor {hf_name!r} gives {tuple(q.shape)} here, expected {tuple(dst.shape)}")
    dst.copy_(q)
    sname = quant.scale_name(hf_name)
    if sname not in where:
        raise ValueError(f"FP8 tensor {hf_name!r} has no {sname!r} beside it")
    scales = where[sname].get_slice(sname)
    if dim == 0:
        cut, at = src or slice(0, shape[0]), rows or slice(0, p.shape[0])
        s = scales[cut.start // bn: -(-cut.stop // bn)]
        scale[at.start // bn: -(-at.stop // bn)].copy_(s)
    else:
        cut = src or slice(0, shape[1])
        s = scales[:, cut.start // bk: -(-cut.stop // bk)]
        scale.copy_(s)
    return [("", q.numel()), ("_scale", s.numel())]


def _load_safetensors(model: CausalLM, path: str, params: dict) -> None:
    """Reads only this rank's slices of each tensor (safetensors' lazy slices); an FP8 weight of a
    block-scaled checkpoint (engine/fp8.py) goes as it is, with its scales' slice, into a layer
    held in FP8 (_hold_fp8), else is read whole with its scales, dequantized, then sliced."""
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
                fp8 = part.get_dtype().startswith("F8")
                for target, rows, dim, src in model.shard_targets(hf_name):
                    name, _, index = target.partition("[")  # "w_down[3]": expert 3 of a fused tensor
                    if name not in params:
                        raise ValueError(f"unexpected tensor {hf_name!r} in {file}")
                    p = params[name].data
                    if fp8 and p.dtype == torch.float8_e4m3fn:  # held in FP8: values and scales as they are
                        scale = params[name + "_scale"].data
                        if index:  # one expert's, of fused experts
                            p, scale = p[int(index.rstrip("]"))], scale[int(index.rstrip("]"))]
                        for got, count in _copy_fp8(part, where, quant, hf_name, p, scale, rows, dim, src):
                            loaded[name + got] = loaded.get(name + got, 0) + count
                        continue
                    if fp8 and whole is None:
                        whole = _dequantized(hf_name, part, where, quant, path)
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
