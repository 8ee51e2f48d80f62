"""Kernels (Triton: GPU, or CPU under TRITON_INTERPRET=1) and their plain-torch references.
Triton is imported lazily so that a CPU install without it still works.

    attention_core     what every attention kernel shares: online softmax, key splits, planner
    triton_attention   paged decode attention (GQA)
    triton_prefill     paged prefill attention of a mixed step (GQA)
    triton_mla         paged latent attention's decode (MLA)
    kv_store           the one KV-store kernel (every cache code; a latent row alone)
    kv_quant           int8 / fp8 / int4 KV codes in the slab, their torch path
    triton_int4        int4 rows: the store's encoder, the tile loader's decoder
    triton_fused       fused RMSNorm, rope and SiLU
    triton_moe         the fused mixture-of-experts kernel
    block_copy         blocks by id from one slab into another (the same-node handoff's pull)
    oneshot_allreduce  the TP all-reduce over buffers every rank maps
    compile_watch      kernel variants compiled while serving, counted and named
    attention_ref, mla_ref, moe_ref   the torch references
"""

from .attention_ref import gather_kv, paged_attention_ref, store_kv_ref

__all__ = ["gather_kv", "paged_attention_ref", "store_kv_ref", "triton_available"]


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
