"""The watch over Triton kernel variants compiled while serving (ops/compile_watch.py): installed as
Triton's own JIT cache hook, chained to one that was there before, counting and naming what
compiles after arm() (manual warm-ups not), never stopping a compile. On CUDA a kernel variant
first launched after arm() is counted by name; the CPU interpreter compiles nothing."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from pdserve.engine.ops import compile_watch  # noqa: E402
from pdserve.engine.ops.compile_watch import CompileWatch  # noqa: E402


def _hook_slot():
    knobs = getattr(triton, "knobs", None)
    if knobs is not None and hasattr(knobs.runtime, "jit_cache_hook"):
        return knobs.runtime, "jit_cache_hook"
    from triton.runtime.jit import JITFunction

    return JITFunction, "cache_hook"


@pytest.fixture
def fresh(monkeypatch):
    """A process as if no watch were armed yet, with a hook of someone else's already installed."""
    owner, attr = _hook_slot()
    seen = []

    def theirs(**kw):
        seen.append(kw["repr"])
        return False

    monkeypatch.setattr(owner, attr, theirs)
    monkeypatch.setattr(CompileWatch, "_armed", None)
    return owner, attr, seen


def test_armed_once_as_tritons_hook_counting_what_compiles_and_chaining(fresh, caplog):
    owner, attr, seen = fresh
    watch = CompileWatch.arm("w0")
    assert CompileWatch.arm("w1") is watch and getattr(owner, attr) == watch.hook  # once per process
    for i in range(compile_watch.KEEP + 2):
        # as Triton's JIT calls it before compiling a variant: falsy means "compile it"
        assert not watch.hook(key=i, repr=f"_k{i}[num_warps=4](x: *fp32)", fn=None, compile={},
                              is_manual_warmup=False, already_compiled=False)
    assert not watch.hook(key=-1, repr="_warm[num_warps=4]()", fn=None, compile={}, is_manual_warmup=True,
                          already_compiled=False)
    assert watch.count == compile_watch.KEEP + 2  # the manual warm-up is not a stall
    assert watch.recent() == [f"_k{i}[num_warps=4](x: *fp32)" for i in range(2, compile_watch.KEEP + 2)]
    assert len(seen) == compile_watch.KEEP + 3  # the hook that was there still sees every compile
    assert "w0: kernel variant compiled while serving (#1): _k0" in caplog.text


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the CPU interpreter compiles nothing")
def test_a_variant_first_launched_after_arm_is_counted_by_name(fresh):
    import triton.language as tl

    @triton.jit
    def _watched_scale(x_ptr, n, FACTOR: tl.constexpr):
        offs = tl.arange(0, 128)
        tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * FACTOR, mask=offs < n)

    x = torch.ones(128, device="cuda")
    _watched_scale[(1,)](x, 128, FACTOR=2.0)  # compiled before: not counted
    watch = CompileWatch.arm()
    before = watch.count
    _watched_scale[(1,)](x, 128, FACTOR=2.0)  # cached
    assert watch.count == before
    _watched_scale[(1,)](x, 128, FACTOR=3.0)  # a new constant: a new variant
    assert watch.count == before + 1 and "_watched_scale" in watch.recent()[-1]
    assert torch.equal(x, torch.full_like(x, 12.0))  # and it ran
