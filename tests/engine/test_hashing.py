import subprocess
import sys

import pytest

from pdserve.engine.base.hashing import ROOT_HASH, hash_block, hash_block_tokens


def test_chain_covers_full_blocks_only_and_extends():
    toks = list(range(40))
    hashes = hash_block_tokens(toks, 16)
    assert len(hashes) == 2  # the partial third block is not hashed
    assert hashes[0] == hash_block(ROOT_HASH, toks[:16])
    assert hashes[1] == hash_block(hashes[0], toks[16:32])
    # extending from block 1 with its parent gives the same chain
    assert hash_block_tokens(toks, 16, start_block=1, parent=hashes[0]) == hashes[1:]
    # the chain (tokens encoded once for all blocks) is hash_block's, block by block, extra keys too
    keys = ("model-x", 3)
    chain, parent = [], ROOT_HASH
    for i in range(2):
        parent = hash_block(parent, toks[16 * i: 16 * i + 16], keys)
        chain.append(parent)
    assert hash_block_tokens(toks, 16, keys) == chain


def test_hash_depends_on_parent_tokens_and_extra_keys():
    a = hash_block_tokens([1] * 32, 16)
    b = hash_block_tokens([2] * 16 + [1] * 16, 16)
    assert a[1] != b[1]  # same tokens in block 1, different prefix
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(ROOT_HASH, [1, 2], extra_keys=("lora-a",))
    assert hash_block(ROOT_HASH, [1, 2]) != hash_block(ROOT_HASH, [2, 1])


@pytest.mark.slow
def test_hash_is_stable_across_processes():
    code = ("from pdserve.engine.base.hashing import hash_block_tokens;"
            "print(hash_block_tokens(list(range(64)), 16, ('m',))[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout.strip()
            for seed in ("1", "2", "random")}
    assert len(outs) == 1
    assert outs.pop() == hash_block_tokens(list(range(64)), 16, ("m",))[-1].hex()
