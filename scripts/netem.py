"""A link with delay and loss, in user space: what `tc qdisc ... netem` does, for kernels built
without sch_netem (this one's: "Specified qdisc kind is unknown").

    python3 scripts/netem.py IF_A IF_B --delay-ms 100 --loss 0.01 [--seed N]

Relays every Ethernet frame that arrives on IF_A out of IF_B and every one that arrives on IF_B
out of IF_A (two AF_PACKET sockets; the two interfaces are the ends of a link that
`scripts/hosts.sh impair` has cut in two), each frame held `--delay-ms` and dropped with
probability `--loss`, in each direction: as netem on both ends of the link. Frames keep their
order. The sockets carry the kernel's virtio-net header (PACKET_VNET_HDR), so a frame whose
checksum the sender left to the device keeps that note across the relay; the senders are asked
for one TCP segment per frame (`gso_max_segs 1` by the caller), so a loss drops one segment, as
on a wire. Like netem, a queue of more than `--limit` frames drops what comes next. Runs until
killed (SIGTERM, SIGKILL); prints "relaying" when both sockets are bound.
"""

from __future__ import annotations

import argparse
import heapq
import random
import select
import signal
import socket
import sys
import time

ETH_P_ALL = 0x0003
SOL_PACKET = 263
PACKET_VNET_HDR = 15
PACKET_IGNORE_OUTGOING = 23
PACKET_OUTGOING = 4


def bind(ifname: str) -> socket.socket:
    s = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(ETH_P_ALL))
    s.setsockopt(SOL_PACKET, PACKET_VNET_HDR, 1)
    s.setsockopt(SOL_PACKET, PACKET_IGNORE_OUTGOING, 1)  # not the frames this relay sends out of it
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.bind((ifname, ETH_P_ALL))
    s.setblocking(False)
    return s


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("a")
    ap.add_argument("b")
    ap.add_argument("--delay-ms", type=float, default=0.0, help="each frame's delay, each way")
    ap.add_argument("--loss", type=float, default=0.0, help="each frame's chance to be dropped (0..1)")
    ap.add_argument("--limit", type=int, default=10000, help="frames held at most (netem's limit)")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()
    if not 0.0 <= args.loss < 1.0 or args.delay_ms < 0:
        sys.exit(f"netem.py: --loss must be in [0, 1) and --delay-ms >= 0, got {args.loss}, {args.delay_ms}")
    rng = random.Random(args.seed)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ends = {s.fileno(): s for s in (bind(args.a), bind(args.b))}
    other = dict(zip(ends, reversed(list(ends.values()))))
    delay = args.delay_ms / 1000.0
    held: list[tuple[float, int, socket.socket, bytes]] = []  # (due, order, out of, frame)
    order = 0
    print("relaying", flush=True)
    while True:
        wait = max(0.0, held[0][0] - time.monotonic()) if held else None
        ready, _, _ = select.select(list(ends), [], [], wait)
        now = time.monotonic()
        for fd in ready:
            while True:
                try:
                    frame, addr = ends[fd].recvfrom(1 << 17)
                except BlockingIOError:
                    break
                if addr[2] == PACKET_OUTGOING or rng.random() < args.loss or len(held) >= args.limit:
                    continue
                heapq.heappush(held, (now + delay, order, other[fd], frame))
                order += 1
        while held and held[0][0] <= now:
            _, _, out, frame = heapq.heappop(held)
            try:
                out.send(frame)
            except OSError:  # the far end down (a host's cable out): the frame is lost, as on a wire
                pass


if __name__ == "__main__":
    main()
