"""One description of a KV cache (engine/kv_cache.KVLayout): the engine's, the wire check's
and the persisted tier's agree for every cache dtype, and a peer that differs is refused by
the field that differs."""

from __future__ import annotations

import pytest
import torch

from pdserve.engine.base.kv_layout import KVLayout, kv_layout
from pdserve.engine.config import EngineConfig
from pdserve.engine.engine import LLMEngine
from pdserve.transfer.records import LayoutMismatch, WireLayout


@pytest.mark.parametrize("dtype", ["auto", "int8", "fp8", "int4"])
def test_the_engine_the_wire_and_the_tier_describe_a_cache_one_way(dtype, tiny_models):
    model = tiny_models["llama_hd32" if dtype == "int4" else "llama"]
    eng = LLMEngine(EngineConfig(model=model, kv_cache_dtype=dtype, max_model_len=128, num_gpu_blocks_override=8))
    lay = kv_layout(eng.config)
    assert KVLayout.of(eng.runner.kv, dtype) == lay == eng.runner.layout
    wire = WireLayout.of(eng.runner.kv, 0, kv_cache_dtype=dtype)
    assert wire.kv == lay and WireLayout.from_json(wire.to_json()) == wire  # what a pair's store carries
    assert "kv_cache_dtype" not in wire.fields() and wire.block_bytes == lay.block_bytes  # TP 1: the whole block
    if dtype == "int4":  # head_dim / 2 bytes of codes, then a float16 (scale, min) per 32 values
        assert (lay.dtype, lay.head_dim, lay.scale_bytes, eng.runner.kv.shape[-1]) == ("int4", 32, 4, 20)
        assert lay.block_bytes == eng.runner.kv[0].numel()
    elif dtype != "auto":  # a uint8 slab: head_dim values of the value dtype, the row's scale, padding to 16
        assert lay.dtype == {"int8": "int8", "fp8": "float8_e4m3fn"}[dtype] and lay.scale_bytes == 16
        assert lay.head_dim == eng.runner.kv.shape[-1] - 16 and eng.runner.kv.shape[-1] % 16 == 0
        assert lay.block_bytes == eng.runner.kv[0].numel()


def test_peers_are_refused_by_the_field_that_differs():
    slab = torch.zeros(4, 2, 2, 16, 2, 48, dtype=torch.uint8)
    fp8 = WireLayout.of(slab, 0, kv_cache_dtype="fp8")
    fp8.check(WireLayout.of(slab, 0, kv_cache_dtype="fp8_e4m3"), "peer")  # two names, the same bytes
    with pytest.raises(LayoutMismatch, match="dtypes differ: ours 'float8_e4m3fn', peer 'peer''s 'int8'"):
        fp8.check(WireLayout.of(slab, 0, kv_cache_dtype="int8"), "peer")
    bf16 = WireLayout.of(torch.zeros(4, 2, 2, 16, 2, 32, dtype=torch.bfloat16), 0)
    with pytest.raises(LayoutMismatch, match="dtypes differ.*'bfloat16'.*scale bytes 16 vs 0"):
        fp8.check(bf16, "peer")
    with pytest.raises(LayoutMismatch, match="'block_size': \\(16, 8\\)"):
        bf16.check(WireLayout.of(torch.zeros(8, 2, 2, 8, 2, 32, dtype=torch.bfloat16), 0), "peer")
    with pytest.raises(LayoutMismatch, match="announced no KV layout"):
        bf16.check(None, "peer")
    int4 = WireLayout.of(torch.zeros(4, 2, 2, 16, 2, 20, dtype=torch.uint8), 0, kv_cache_dtype="int4")
    assert (int4.kv.dtype, int4.kv.head_dim, int4.kv.scale_bytes) == ("int4", 32, 4)
    with pytest.raises(LayoutMismatch, match="dtypes differ"):  # 20-byte rows: int4 of 32 values, or int8 of 4
        int4.check(WireLayout.of(torch.zeros(4, 2, 2, 16, 2, 20, dtype=torch.uint8), 0, kv_cache_dtype="int8"),
                   "peer")
    with pytest.raises(ValueError, match="a int8 KV cache is a uint8 slab"):
        KVLayout.of(torch.zeros(4, 2, 2, 16, 2, 32), "int8")


def _resident_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2**20


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads Linux's /proc")
@pytest.mark.parametrize("dtype", ["auto", "int8"])
def test_a_host_cache_costs_memory_as_it_fills_not_up_front(dtype, tiny_models):
    """A 512 MiB CPU cache adds far less than 512 MiB of resident memory, reads as zeros, and
    a written block reads back (kv_cache.zeros_on_demand)."""
    before = _resident_mib()
    eng = LLMEngine(EngineConfig(model=tiny_models["llama"], kv_cache_dtype=dtype, max_model_len=128,
                                 kv_cache_memory_bytes=512 << 20, device="cpu"))  # a CPU cache also on a GPU host
    kv = eng.runner.kv
    assert kv.numel() * kv.element_size() > 500 << 20 and kv.device.type == "cpu"
    assert _resident_mib() - before < 128
    assert not kv[-1].any() and not kv[0].any()
    kv[3].fill_(7)
    assert (kv[3] == 7).all() and not kv[2].any() and not kv[4].any()


_FREED_HEAP_THEN_CACHE = """
import ctypes, torch
from pdserve.engine.exec.kv_cache import zeros_on_demand
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
libc.free(libc.malloc(30 << 20))  # glibc now serves blocks under 30 MiB from its heap
chunks = [libc.malloc(25 << 20) for _ in range(24)]  # 600 MiB of heap, never written
held = libc.malloc(5 << 20)  # keeps the heap's top, so the freed chunks stay in it
for c in chunks:
    libc.free(c)
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20
before = resident()
kv = zeros_on_demand((512 << 20,), torch.uint8)
print(resident() - before)
"""


@pytest.mark.skipif(not __import__("os").path.exists("/proc/self/statm"), reason="reads Linux's /proc")
def test_a_host_cache_stays_lazy_in_a_process_whose_heap_holds_freed_memory():
    """A heap with a large free chunk (a process that allocated and freed many tensors of a few
    MiB, as a CI worker has after other engine tests) does not make the cache commit its pages."""
    import subprocess
    import sys
    out = subprocess.run([sys.executable, "-c", _FREED_HEAP_THEN_CACHE], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert float(out) < 64, f"a 512 MiB cache committed {out.strip()} MiB up front"
