"""Baseline for `pdserve bench`: Hugging Face transformers `generate`, batched, behind the
same OpenAI `/v1/completions` streaming API, one model replica per GPU.

Each GPU's loop takes up to --max-batch waiting requests, left-pads them into one batch
and runs `model.generate` (greedy, static batch: requests that arrive meanwhile wait
for the next batch); a streamer timestamps every decoding step and streams each
request's tokens as they come. This is how `generate` serves: no continuous batching,
no paged KV.

    python bench/hf_server.py --model DIR [--dummy] [--gpus 2] [--max-batch 64] --port 8100
"""

from __future__ import annotations

import argparse
import asyncio
import json
import queue
import threading
import time
import uuid

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import BaseStreamer


class Job:
    def __init__(self, ids: list[int], max_tokens: int, loop: asyncio.AbstractEventLoop):
        self.ids, self.max_tokens, self.loop = ids, max_tokens, loop
        self.out: asyncio.Queue = asyncio.Queue()
        self.n = 0

    def push(self, item) -> None:
        self.loop.call_soon_threadsafe(self.out.put_nowait, item)


class StepStreamer(BaseStreamer):
    """Receives the prompt once, then one [batch] tensor of new tokens per step."""

    def __init__(self, jobs: list[Job]):
        self.jobs, self.seen_prompt = jobs, False

    def put(self, value):
        if not self.seen_prompt:
            self.seen_prompt = True
            return
        toks = value.view(-1).tolist()
        for job, tok in zip(self.jobs, toks):
            if job.n < job.max_tokens:
                job.n += 1
                job.push(tok)

    def end(self):
        for job in self.jobs:
            job.push(None)


def gpu_loop(model, device: str, jobs: queue.Queue, max_batch: int, pad_id: int) -> None:
    while True:
        batch = [jobs.get()]
        while len(batch) < max_batch:
            try:
                batch.append(jobs.get_nowait())
            except queue.Empty:
                break
        width = max(len(j.ids) for j in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, j in enumerate(batch):  # left padding
            ids[i, width - len(j.ids):] = torch.tensor(j.ids)
            mask[i, width - len(j.ids):] = 1
        try:
            with torch.inference_mode():
                model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=False,
                               max_new_tokens=max(j.max_tokens for j in batch),
                               min_new_tokens=max(j.max_tokens for j in batch), pad_token_id=pad_id,
                               streamer=StepStreamer(batch))
        except Exception as e:  # noqa: BLE001 - report to every request of the batch
            for j in batch:
                j.push(e)


def build(args) -> FastAPI:
    tok = AutoTokenizer.from_pretrained(args.model)
    config = AutoConfig.from_pretrained(args.model)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    queues = []
    dtype = torch.bfloat16 if args.gpus else torch.float32
    for device in [f"cuda:{g}" for g in range(args.gpus)] or ["cpu"]:  # --gpus 0: a CPU smoke test
        if args.dummy:
            with torch.device(device):  # initialized on the GPU (normal, std = initializer_range)
                model = AutoModelForCausalLM.from_config(config, torch_dtype=dtype)
        else:
            model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=dtype).to(device)
        model.eval()
        model.generation_config.eos_token_id = None
        q: queue.Queue = queue.Queue()
        threading.Thread(target=gpu_loop, args=(model, device, q, args.max_batch, pad_id), daemon=True).start()
        queues.append(q)
    app = FastAPI()
    counter = iter(range(1 << 62))

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": args.served_model_name, "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else tok.encode(prompt)
        job = Job(ids, int(body.get("max_tokens", 16)), asyncio.get_running_loop())
        queues[next(counter) % len(queues)].put(job)  # round robin over the GPUs
        rid, created = f"cmpl-{uuid.uuid4().hex[:12]}", int(time.time())

        def chunk(choices, **extra):
            return "data: " + json.dumps({"id": rid, "object": "text_completion", "created": created,
                                          "model": args.served_model_name, "choices": choices, **extra}) + "\n\n"

        async def stream():
            n = 0
            while True:
                item = await job.out.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    yield "data: " + json.dumps({"error": {"message": str(item), "type": "server_error"}}) + "\n\n"
                    return
                n += 1
                yield chunk([{"index": 0, "text": tok.decode([item]), "finish_reason": None}])
            yield chunk([{"index": 0, "text": "", "finish_reason": "length"}])
            yield chunk([], usage={"prompt_tokens": len(ids), "completion_tokens": n,
                                   "total_tokens": len(ids) + n})
            yield "data: [DONE]\n\n"

        if body.get("stream"):
            return StreamingResponse(stream(), media_type="text/event-stream")
        toks = []
        while (item := await job.out.get()) is not None:
            if isinstance(item, Exception):
                return JSONResponse({"error": {"message": str(item), "type": "server_error"}}, status_code=500)
            toks.append(item)
        return {"id": rid, "object": "text_completion", "created": created, "model": args.served_model_name,
                "choices": [{"index": 0, "text": tok.decode(toks), "finish_reason": "length"}],
                "usage": {"prompt_tokens": len(ids), "completion_tokens": len(toks),
                          "total_tokens": len(ids) + len(toks)}}

    return app


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dummy", action="store_true", help="random weights of the config's shape")
    ap.add_argument("--gpus", type=int, default=torch.cuda.device_count())
    ap.add_argument("--max-batch", type=int, default=64)
    ap.add_argument("--served-model-name", default="hf")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8100)
    args = ap.parse_args()
    uvicorn.run(build(args), host=args.host, port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
