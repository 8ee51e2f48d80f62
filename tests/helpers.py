"""Test helpers shared across test modules (importable: tests/ is on pythonpath)."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time

import torch

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "Write a short poem about the sea and the wind that moves the waves across the endless blue.",
    "1, 2, 3, 4, 5,",
    "In a distant future, humanity has spread across the stars. The first colony ships",
    "def fibonacci(n):",
    "Q: What is the boiling point of water at sea level?\nA:",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog again"
    " and again, until the dog finally wakes up and",
    "Once upon a time",
]

# token-id prompts for tiny random models (ids < 500): two sharing a 24-token prefix, one short
ID_PROMPTS = [[(37 * i + 11) % 500 + 3 for i in range(40)], [(37 * i + 11) % 500 + 3 for i in range(24)] + [7, 9],
              [(13 * i + 5) % 500 + 3 for i in range(19)]]


HF_CLASSES = {"llama": ("LlamaConfig", "LlamaForCausalLM"), "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
              "mistral": ("MistralConfig", "MistralForCausalLM"), "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
              "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
              "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
              "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM"),
              "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}


def save_hf(kind: str, cfg_kwargs: dict, out_dir: str, tokenizer_dir: str, seed: int = 1234,
            bias_std: float = 0.0):
    """A random Hugging Face model of `kind` saved as a model directory with the given
    tokenizer's files; biases (zero at init) drawn with `bias_std` when set. Returns the model."""
    import transformers

    cfg_cls, model_cls = (getattr(transformers, name) for name in HF_CLASSES[kind])
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**cfg_kwargs)).eval()
    if bias_std:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.normal_(0, bias_std)
    with torch.no_grad():  # routers drawn wide enough that no two experts tie for a token
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight") or name.endswith("block_sparse_moe.gate.weight"):
                p.normal_(0, 1.0)
        for name, b in model.named_buffers():  # DeepSeek-V3's correction bias (zero at init) takes part
            if name.endswith("e_score_correction_bias"):
                b.uniform_(-0.5, 0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    for f in os.listdir(tokenizer_dir):
        if f.startswith("tokenizer") or f.endswith(".jinja") or f == "special_tokens_map.json":
            shutil.copy(os.path.join(tokenizer_dir, f), out_dir)
    return model


def save_tiny(kind: str, out_dir: str, tokenizer_dir: str, max_positions: int = 512) -> str:
    """A tiny random model of `kind` under out_dir (Hugging Face's own classes), with the
    tokenizer's files; `max_positions`: its max_position_embeddings (what max_model_len may reach)."""
    common = dict(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, max_position_embeddings=max_positions, initializer_range=0.15,
                  bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if kind == "llama":  # GQA 4:2 + llama3 rope scaling that changes low frequencies
        cfg = dict(common, num_key_value_heads=2, rope_theta=500000.0,
                   rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                 "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    elif kind == "qwen2":  # qkv bias, tied embeddings, GQA 4:1
        cfg = dict(common, num_key_value_heads=1, tie_word_embeddings=True)
    elif kind == "mistral":  # a sliding window shorter than the sequences
        cfg = dict(common, num_key_value_heads=2, sliding_window=24)
    elif kind == "llama_hd32":  # head_dim 32: what int4 KV packs (groups of 32), GQA 4:2
        cfg = dict(common, hidden_size=128, num_key_value_heads=2)
    else:
        raise ValueError(kind)
    save_hf(kind.removesuffix("_hd32"), cfg, out_dir, tokenizer_dir)
    return out_dir


def hf_greedy(model_dir: str, prompts: list[list[int]], max_new_tokens: int, batched: bool = False) -> list[list[int]]:
    """Hugging Face transformers' own greedy generate, one prompt at a time (no padding); `batched`:
    all prompts in one generate, left-padded under an attention mask (the default model's references
    in test_correctness_hf: 5 s instead of 20 on 2 cores, the same tokens as one at a time; a tiny
    random model's near-tied logits could tell padding apart, so they stay one at a time)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # run to max_new_tokens, like ignore_eos
    with torch.no_grad():
        if batched:
            n = max(map(len, prompts))
            x = torch.tensor([[0] * (n - len(ids)) + ids for ids in prompts])
            mask = torch.tensor([[0] * (n - len(ids)) + [1] * len(ids) for ids in prompts])
            y = model.generate(x, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
            return y[:, n:].tolist()
        outs = []
        for ids in prompts:
            x = torch.tensor([ids])
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new_tokens,
                               do_sample=False, pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serving_port(proc, timeout_s: float = 300) -> int:
    """The port a `pdserve serve --port 0` subprocess (stdout a text pipe) listens on, read from its
    serving line, which it prints only once the port is bound: the caller connects at once."""
    deadline = time.monotonic() + timeout_s
    while "pdserve: serving" not in (line := proc.stdout.readline()):
        assert line and time.monotonic() < deadline, proc.stderr.read()[-3000:]
    return int(line.split(" on http://", 1)[1].split(" ", 1)[0].rsplit(":", 1)[1])


def stop_server(proc, timeout_s: float = 120) -> str:
    """Ctrl-C to a `pdserve serve` subprocess started in a process group of its own (it stops
    its Ray, workers and router); SIGKILL to the group if it has not ended in `timeout_s`.
    Returns what it wrote to stderr (text mode)."""
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, err = proc.communicate()
    return err or ""


class Server:
    """A real uvicorn server on 127.0.0.1 in a thread."""

    def __init__(self, app, **config):
        import uvicorn

        from pdserve.router.server import config as server_config

        self.port = free_port()
        self.server = uvicorn.Server(server_config(app, "127.0.0.1", self.port, "warning", **config))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.05)
        self.url = f"http://127.0.0.1:{self.port}"

    def stop(self):
        self.server.should_exit = True
        self.thread.join(10)


class RayHead:
    """`ray start --head --block` in a session of its own (its own temp dir too), stopped by
    signalling that process group: the test stops the Ray it started and nothing else
    (`ray stop` would end every Ray process of the machine, other users' clusters included)."""

    def __init__(self, port: int, *args: str, env: dict | None = None):
        import subprocess
        import sys
        import tempfile

        self.temp_dir = tempfile.mkdtemp(prefix="rayhead", dir="/tmp")  # short: Ray's socket paths
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", f"--port={port}", "--block",
             "--include-dashboard=false", "--disable-usage-stats", f"--temp-dir={self.temp_dir}", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True, env=env)
        deadline = time.monotonic() + 120
        while not _listening(port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"ray start --head on port {port} did not come up")
            time.sleep(0.2)

    def stop(self) -> None:
        import signal

        # `ray start --block` answers SIGTERM by stopping its processes one by one, a second or more each
        # (17 s seen); 3 s, then the whole group killed: nothing of a test's Ray needs a graceful end
        for sig, wait in ((signal.SIGTERM, 3), (signal.SIGKILL, 5)):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline and _group_alive(self.proc.pid):
                self.proc.poll()
                time.sleep(0.2)
        self.proc.poll()
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except ProcessLookupError:
        return False


def group_processes(pgid: int) -> dict[int, str]:
    """pid -> name (its title, as ps shows it) of each running process of group `pgid` (Linux)."""
    out = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue
            with open(f"/proc/{pid}/cmdline") as f:
                cmd = f.read().split("\0")
            with open(f"/proc/{pid}/comm") as f:
                comm = f.read().strip()
            out[int(pid)] = cmd[0].split(" ")[0] if cmd[0].startswith("ray::") else comm
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return out


def listening_sockets(pgid: int) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every TCP socket that a process of group `pgid` listens
    on, read from /proc (Linux): the sockets' inodes, matched to the group's open files."""
    import ipaddress

    inodes = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] != "0A":  # LISTEN
                    continue
                hexip, hexport = cols[1].split(":")
                raw = bytes.fromhex(hexip)
                # each 32-bit word is in host (little-endian) order
                raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
                ip = ipaddress.ip_address(raw)
                if ip.version == 6 and ip.ipv4_mapped is not None:
                    ip = ip.ipv4_mapped
                inodes[cols[9]] = (str(ip), int(hexport, 16))
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.getpgid(int(pid)) != pgid:
                continue
            with open(f"/proc/{pid}/comm") as f:
                name = f.read().strip()
            for fd in os.listdir(f"/proc/{pid}/fd"):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:[") and target[8:-1] in inodes:
                    out.append((*inodes[target[8:-1]], name))
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            continue
    return sorted(set(out))


def role_of(cluster, worker_id: str) -> str | None:
    """The pool a worker of `cluster` serves in now (worker ids do not name a role: a worker
    may switch); None for a worker that is gone."""
    w = cluster.workers.get(worker_id)
    return w.role if w is not None else None


def run_disagg(pw, dw, prompts, params):
    """Drives a PrefillRole `pw` and a DecodeRole `dw` (named prefill-0 and decode-0 on their
    connectors) as their actors would: every request goes to both at once; the
    decode role's Reserved events become the prefill role's targets. params: one for all, or
    one per prompt."""
    from pdserve.engine.role import Emitted, Reserved, Sent

    finals, sent, skips = {}, {}, {}
    each = params if isinstance(params, list) else [params] * len(prompts)
    for i, (p, sp) in enumerate(zip(prompts, each)):
        ids = pw.engine.tokenize(p)
        to_decode = sp.max_tokens != 1
        pw.add(f"r{i}", valid(pw.engine, ids, sp), "decode-0" if to_decode else None)
        if to_decode:
            dw.add(f"r{i}", valid(dw.engine, ids, sp), "prefill-0")
    while pw.num_inflight or dw.num_inflight:
        for ev in pw.step() + dw.step():
            if isinstance(ev, Reserved):
                assert ev.peer == "prefill-0"
                skips[ev.request_id] = ev.target.num_skip
                pw.target(ev.request_id, ev.target)
            elif isinstance(ev, Sent):
                assert ev.result.ok, ev.result
                sent[ev.request_id] = (ev.result.nbytes, skips[ev.request_id])
            elif isinstance(ev, Emitted) and ev.output.finished:
                finals[ev.output.request_id] = ev.output
    return [finals[f"r{i}"] for i in range(len(prompts))], sent


def valid(engine, ids: list[int], params):
    """`ids` and `params` as the edge hands them to a role (engine/validation.check_request against
    the engine's model): what a cluster's dispatcher gives a worker."""
    from pdserve.engine.validation import check_request

    return check_request(list(ids), params, engine.config.max_model_len, engine.model_config.vocab_size,
                         bounded=engine.config.kv_window_tokens is None)


class Tmpfs:
    """A real file system of `size` mounted at `path` for a test (root only: the test skips
    otherwise): a full disk is ENOSPC from the kernel, `read_only()` remounts it as an operator's
    `mount -o remount,ro` would. Unmounted when the `with` ends, whatever happened."""

    def __init__(self, path, size: str = "1m"):
        import pytest

        self.path = str(path)
        os.makedirs(self.path, exist_ok=True)
        out = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "pdserve-test", self.path],
                             capture_output=True, text=True)
        if out.returncode != 0:
            pytest.skip(f"mounting a tmpfs needs root: {out.stderr.strip()}")

    def read_only(self, ro: bool = True) -> None:
        subprocess.run(["mount", "-o", f"remount,{'ro' if ro else 'rw'}", self.path], check=True)

    def __enter__(self) -> Tmpfs:
        return self

    def __exit__(self, *exc) -> None:
        subprocess.run(["umount", "-l", self.path], capture_output=True)
