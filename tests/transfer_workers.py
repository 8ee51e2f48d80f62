"""Worker processes for the transfer tests: each owns a KV tensor, a KV-cache manager
and a real C10dConnector (gloo on CPU), and runs commands from a queue."""

from __future__ import annotations

import os
import time

import torch

SHAPE = dict(num_blocks=400, layers=2, block_size=16, kv_heads=2, head_dim=8)


def make_kv(seed: int, num_blocks: int = SHAPE["num_blocks"], head_dim: int = SHAPE["head_dim"],
            shared: bool = False) -> torch.Tensor:
    """Random KV; `shared`: on a memory file a peer of this host can map (the engine's CPU slab)."""
    from pdserve.engine.exec.kv_cache import zeros_on_demand

    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(num_blocks, SHAPE["layers"], 2, SHAPE["block_size"], SHAPE["kv_heads"], head_dim, generator=g)
    if not shared:
        return kv
    out = zeros_on_demand(tuple(kv.shape), kv.dtype)
    out.copy_(kv)
    return out


_CONTEXT = None


def context():
    """The processes' start method: a fork server that has imported torch and the transfer code
    once per test process (a fresh interpreter each, as "spawn" started them, cost 2-7 s of imports
    per peer on 2 cores, about a third of the transfer tests' time). Nothing in it touches a GPU
    or starts a thread before it forks."""
    global _CONTEXT
    if _CONTEXT is None:
        import multiprocessing as mp

        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "pdserve.transfer.c10d", "pdserve.transfer.pull",
                                         "pdserve.engine.exec.kv_cache", "transfer_workers"])
    return _CONTEXT


class Peer:
    """A worker process (peer_main) driven through its queues."""

    def __init__(self, name: str, seed: int, head_dim: int = SHAPE["head_dim"], link: str = "c10d",
                 device: str = "cpu"):
        ctx = context()
        self.name, self.seed = name, seed
        self.cmd, self.res = ctx.Queue(), ctx.Queue()
        self.proc = ctx.Process(target=peer_main, args=(name, seed, self.cmd, self.res, head_dim, link, device),
                                daemon=True)
        self.proc.start()
        self.address = self.get("ready")

    def call(self, cmd, args=None):
        self.cmd.put((cmd, args))

    def get(self, kind, timeout=60):
        k, v = self.res.get(timeout=timeout)
        assert k == kind, (k, v)
        return v

    def ask(self, cmd, args=None, kind=None, timeout=60):
        self.call(cmd, args)
        return self.get(kind, timeout)

    def stop(self):
        if self.proc.is_alive():
            self.call("stop")
            self.proc.join(10)
        if self.proc.is_alive():
            self.proc.kill()


def handoff(prefill: Peer, decode: Peer, rid: str, src_ids, dst_ids, timeout=20.0, die=False):
    """One handoff from `prefill` to `decode`: a channel, the receive posted, then the send."""
    (ch,) = decode.ask("channel", (prefill.name, 1), "channels")
    decode.call("recv", {"ops": [(prefill.name, "", rid, dst_ids, ch, timeout)]})
    prefill.call("send", {"ops": [(decode.name, decode.address, rid, src_ids, ch, timeout)], "die": die})
    return ch


def _wait_all(conn, handoffs):
    pending = {h.request_id: h for h in handoffs}
    results = {}
    while pending:
        for h in conn.poll():
            if h.request_id in pending:
                del pending[h.request_id]
                results[h.request_id] = (h.state.name, h.error, h.nbytes, h.seconds, h.meta)
        time.sleep(0.005)
    return results


def peer_main(name: str, seed: int, cmd_q, res_q, head_dim: int = SHAPE["head_dim"], link: str = "c10d",
              device: str = "cpu") -> None:
    """link "pull": a same-host pair pulls the sender's KV mapped in (a shared memory file on CPU,
    CUDA IPC on a GPU: transfer/pull.py); "c10d": over a gloo (NCCL) group."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    from pdserve.engine.core.kv_cache_manager import KVCacheManager
    from pdserve.engine.core.request import Request
    from pdserve.engine.sampling_params import SamplingParams
    from pdserve.transfer import HandoffTarget
    from pdserve.transfer.base import HandoffMeta
    from pdserve.transfer.c10d import C10dConnector

    def send(peer, address, rid, block_ids, channel, timeout=None, heads=None):  # meta: a span names the request
        return conn.start_send(HandoffTarget(peer, address, channel, 0), rid, block_ids, timeout,
                               meta=HandoffMeta(len(block_ids), {rid: 0.0}), heads=heads)

    def recv(peer, _address, rid, block_ids, channel, timeout=None, wait_s=None):
        return conn.start_recv(peer, rid, block_ids, channel, timeout, wait_s=wait_s)

    if link == "pull-no-doorbell":  # a receiver whose doorbell cannot be made: both sides poll
        from pdserve.transfer.pull import PullLink

        PullLink.listen = lambda self: None
        link = "pull"
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device).index or 0)  # "cuda": the first GPU
    kv = make_kv(seed, head_dim=head_dim, shared=device == "cpu").to(device)
    kvm = KVCacheManager(kv.shape[0], SHAPE["block_size"])
    conn = C10dConnector(name, kv, min_chunk_bytes=16 << 10, same_node=link == "pull")  # 4 KiB blocks: many chunks
    reqs: dict[str, Request] = {}
    res_q.put(("ready", conn.address))
    while True:
        cmd, args = cmd_q.get()
        try:
            if cmd == "stop":
                conn.close()
                res_q.put(("stopped", None))
                return
            if cmd == "channel":  # receiver: channels for the next handoffs from a peer
                peer, n = args
                res_q.put(("channels", [conn.new_channel(peer) for _ in range(n)]))
            elif cmd == "send":  # [(peer, address, rid, block_ids, channel, timeout)]
                if args.get("die"):  # crash with the receiver's side of the handoff in flight
                    time.sleep(0.3)
                    os._exit(17)
                if args.get("die_after_order"):  # crash right after a pulled order is posted
                    import pdserve.transfer.pull as pull

                    pull.wait_key = lambda *a: os._exit(19)
                hs = [send(*a) for a in args["ops"]]
                res_q.put(("results", _wait_all(conn, hs)))
            elif cmd == "send_abort":  # start a handoff, then give up on it (a client went away)
                h = send(*args)
                time.sleep(0.3)
                conn.abort(args[2])
                res_q.put(("results", _wait_all(conn, [h])))
            elif cmd == "send_abort_settle":  # sends; the first is given up on the wire, to settle
                hs = [send(*a) for a in args["ops"]]
                time.sleep(0.3)
                res_q.put(("abort", conn.abort(args["ops"][0][2], settle=True).name))
                res_q.put(("results", _wait_all(conn, hs)))
            elif cmd == "recv":
                if args.get("slow_pull"):  # a copy that takes this long (the sender may die meanwhile)
                    import pdserve.transfer.pull as pull

                    def slow(*a, copy=pull.copy_blocks, delay=args["slow_pull"], **k):
                        time.sleep(delay)
                        copy(*a, **k)

                    pull.copy_blocks = slow
                if args.get("die"):
                    time.sleep(0.3)
                    os._exit(18)
                hs = [recv(*a) for a in args["ops"]]
                if args.get("forget"):  # the peer left the cluster (what the cluster's monitor says)
                    peer, after = args["forget"]
                    time.sleep(after)
                    conn.forget_peer(peer)
                out = _wait_all(conn, hs)
                blocks = {a[2]: kv[a[3]].cpu() for a in args["ops"]}
                res_q.put(("results", (out, blocks)))
            elif cmd == "prefill":  # allocate + fill blocks for a prompt as a prefill would
                rid, tokens = args
                r = Request(rid, tokens, SamplingParams(max_tokens=1), max_tokens=1)
                hits, n = kvm.get_computed_blocks(r)
                kvm.allocate_slots(r, len(tokens) - n, hits)
                r.num_computed_tokens = len(tokens)
                kvm.cache_blocks(r, len(tokens))
                reqs[rid] = r
                res_q.put(("blocks", kvm.block_ids(rid)))
            elif cmd == "reserve":  # receiver: reserve blocks for a prompt, minus its prefix hits
                rid, tokens = args
                r = Request(rid, tokens, SamplingParams(max_tokens=4), max_tokens=4)
                reqs[rid] = r
                res_q.put(("reserved", kvm.reserve_prompt(r)))
            elif cmd == "cache":  # receiver: publish a request's received blocks (it decoded them)
                r = reqs[args]
                r.num_computed_tokens = r.num_prompt_tokens
                kvm.cache_blocks(r, r.num_prompt_tokens)
                res_q.put(("ok", None))
            elif cmd == "release":
                kvm.free(reqs.pop(args))
                res_q.put(("ok", None))
            elif cmd == "links":
                res_q.put(("links", {link.key: link.as_dict() for link in conn.links()}))
            elif cmd == "blocks_of":
                res_q.put(("tensor", kv[args].cpu()))
            elif cmd == "memory":  # CUDA: (this process's allocated bytes, the GPU's free bytes)
                torch.cuda.synchronize()
                res_q.put(("memory", (torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0])))
            elif cmd == "stats":
                kvm.pool.check_invariants()
                res_q.put(("stats", {"used": kvm.pool.num_used_blocks, "requests": list(kvm.req_blocks),
                                     "pairs": conn.num_pairs}))
        except Exception as e:  # noqa: BLE001 - reported to the test
            res_q.put(("error", f"{type(e).__name__}: {e}"))


# Scenarios the transfer tests run on every device (gloo / shared memory on CPU, NCCL / CUDA IPC
# on GPUs): `new_peer(name, seed)` starts a replacement sender like the first.

def killed_sender_fails_its_handoff_and_a_new_one_serves(p: Peer, d: Peer, new_peer) -> None:
    """The sender crashes with the receiver's side of a handoff posted; the cluster's monitor has
    the receiver forget it (2 s later): the handoff fails at once, not at its timeout, every block
    is freed, the pair is gone, and a new sender's blocks arrive bit-exact."""
    handoff(p, d, "warm", [1], [1])  # the pair exists
    assert p.get("results")["warm"][0] == "DONE" and d.get("results")[0]["warm"][0] == "DONE"
    fill, _ = d.ask("reserve", ("r", list(range(300))), "reserved")
    t = time.monotonic()
    (ch,) = d.ask("channel", (p.name, 1), "channels")
    d.call("recv", {"ops": [(p.name, "", "r", fill, ch, 60.0)], "forget": (p.name, 2.0)})
    p.call("send", {"ops": [(d.name, d.address, "r", list(range(19)), ch, 60.0)], "die": True})
    p.proc.join(10)
    assert p.proc.exitcode == 17
    out, _ = d.get("results", timeout=90)
    assert out["r"][0] == "FAILED" and "left" in out["r"][1], out
    assert time.monotonic() - t < 30  # at once, not after the 60 s timeout
    d.ask("release", "r", "ok")
    st = d.ask("stats", kind="stats")
    assert st["used"] == 0 and st["pairs"] == 0  # every reserved block freed, the pair gone
    p2 = new_peer("prefill-1", p.seed + 2)
    handoff(p2, d, "r3", [9, 8, 7], [10, 11, 12])
    assert p2.get("results")["r3"][0] == "DONE"
    out, blocks = d.get("results")
    assert out["r3"][0] == "DONE" and torch.equal(blocks["r3"], make_kv(p2.seed)[[9, 8, 7]])


def sender_dying_mid_pull_fails_it_by_name(p: Peer, d: Peer, new_peer) -> Peer:
    """The sender dies once its order is posted, while the receiver copies from its mapped slab:
    the receiver finds it gone after the copy and fails the handoff by name (what it copied is
    never used: its blocks are released, not cached); a new sender's blocks arrive bit-exact.
    Returns the new sender."""
    handoff(p, d, "warm", [1], [1])
    assert p.get("results")["warm"][0] == "DONE" and d.get("results")[0]["warm"][0] == "DONE"
    fill, _ = d.ask("reserve", ("r", list(range(64))), "reserved")
    (ch,) = d.ask("channel", (p.name, 1), "channels")
    d.call("recv", {"ops": [(p.name, "", "r", fill, ch, 30.0)], "slow_pull": 1.0})
    p.call("send", {"ops": [(d.name, d.address, "r", [5, 6, 7, 8], ch, 30.0)], "die_after_order": True})
    p.proc.join(20)
    assert p.proc.exitcode == 19
    out, _ = d.get("results", timeout=60)
    assert out["r"][0] == "FAILED" and f"{p.name} died during the pull of r" in out["r"][1], out
    d.ask("release", "r", "ok")
    st = d.ask("stats", kind="stats")
    assert st["used"] == 0 and st["pairs"] == 0
    p2 = new_peer("prefill-1", p.seed + 2)
    handoff(p2, d, "r2", [9, 8, 7], [10, 11, 12])
    assert p2.get("results")["r2"][0] == "DONE"
    out, blocks = d.get("results")
    assert out["r2"][0] == "DONE" and torch.equal(blocks["r2"], make_kv(p2.seed)[[9, 8, 7]])
    return p2


def blocks_arrive_bit_exact(p: Peer, d: Peer) -> None:
    """One block, scattered ids, then 300 blocks reversed: every handoff DONE on both sides and
    the receiver's blocks equal the sender's, bit for bit."""
    for i, (src, dst) in enumerate((([5], [7]), ([3, 90, 17, 250, 4], [300, 1, 77, 2, 150]),
                                    (list(range(10, 310)), list(range(399, 99, -1))))):
        handoff(p, d, f"r{i}", src, dst)
        assert p.get("results")[f"r{i}"][0] == "DONE"
        out, blocks = d.get("results")
        assert out[f"r{i}"][0] == "DONE", out
        assert torch.equal(blocks[f"r{i}"], make_kv(p.seed)[src])
