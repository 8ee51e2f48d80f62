"""What a vLLM client sends and reads, against the real server (uvicorn, a real hybrid Ray
cluster, the official `openai` client): continuous usage counted as vLLM counts it, a forced
tool call cut by max_tokens, vLLM's request extras and response keys, serving under a root
path, the metrics a vLLM dashboard reads, and the newcomer's papercuts (the served name, the
admin CLI given the OpenAI base URL, the bench's SLO)."""

from __future__ import annotations

import json
import random
import threading
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.cluster import Cluster
from pdserve.router.app import build_app

from helpers import Server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "Tell me about the weather in Paris."}]


@pytest.fixture(scope="module")
def served(shared_ray):
    c = Cluster.start(max_model_len=512, prefill=1, decode=1, mode="hybrid")
    s = Server(build_app(c))
    yield c, s, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    s.stop()
    c.shutdown()


def model_of(client) -> str:
    return client.models.list().data[0].id


def test_the_default_model_is_served_under_its_own_name(served):
    """The README's name: a client that uses it is served (it was `SmolLM2-135M-Instruct-v1`, the
    cache folder's name, and the README's name got a 404)."""
    _, _, client = served
    assert model_of(client) == "SmolLM2-135M-Instruct"
    out = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
    assert out.model == "SmolLM2-135M-Instruct"


def test_continuous_usage_is_counted_as_vllm_counts_it(served):
    """vLLM's test: with include_usage and continuous_usage_stats every chunk carries usage, the
    opening one none of the completion yet, each later chunk with choices more tokens than the
    one before, the last 10; include_usage false: no usage on any chunk."""
    _, _, client = served
    for chat in (True, False):
        create = (lambda **k: client.chat.completions.create(messages=ASK, **k)) if chat else \
            (lambda **k: client.completions.create(prompt="The weather in Paris is", **k))
        kw = dict(model=model_of(client), max_tokens=10, temperature=0, stream=True, extra_body={"ignore_eos": True})
        last, seen = 0, 0
        for chunk in create(stream_options={"include_usage": True, "continuous_usage_stats": True}, **kw):
            u = chunk.usage
            assert u is not None and u.total_tokens == u.prompt_tokens + u.completion_tokens, chunk
            assert last == 0 or u.completion_tokens > last or (not chunk.choices and u.completion_tokens == last), \
                (chat, last, chunk)
            last, seen = u.completion_tokens, seen + 1
        assert last == 10 and seen >= 10, (chat, last, seen)
        for opts in ({"include_usage": False, "continuous_usage_stats": True}, {"include_usage": False}):
            assert all(c.usage is None for c in create(stream_options=opts, **kw)), (chat, opts)


def test_a_forced_tool_call_cut_by_max_tokens_is_no_call_and_no_content(served):
    """tool_choice named or "required" with max_completion_tokens 1 or 6: the grammar's partial JSON
    is neither a call nor an answer: no tool_calls, empty content, finish_reason length (OpenAI's
    and vLLM's contract), streamed too."""
    _, _, client = served
    for choice in ({"type": "function", "function": {"name": "get_weather"}}, "required"):
        for n in (1, 6):
            kw = dict(model=model_of(client), messages=ASK, tools=[WEATHER], tool_choice=choice,
                      max_completion_tokens=n, temperature=0)
            r = client.chat.completions.create(**kw)
            msg = r.choices[0].message
            assert r.choices[0].finish_reason == "length" and not msg.tool_calls and not msg.content, (choice, n, r)
            chunks = [c.choices[0] for c in client.chat.completions.create(stream=True, **kw) if c.choices]
            assert not any(c.delta.tool_calls or c.delta.content for c in chunks), (choice, n, chunks)
            assert chunks[-1].finish_reason == "length"


def test_vllm_request_extras(served):
    """kv_transfer_params (accepted; the reply says what pdserve did with the KV),
    truncate_prompt_tokens (the prompt's last k tokens), logprob_token_ids (their log-probs at
    every token), return_tokens_as_token_ids, and the keys a vLLM reply has unasked."""
    _, server, client = served
    m = model_of(client)
    prompt = [random.Random(5).randrange(100, 40000) for _ in range(80)]
    r = client.completions.create(model=m, prompt=prompt, max_tokens=4, temperature=0,
                                  extra_body={"kv_transfer_params": {"do_remote_decode": True},
                                              "truncate_prompt_tokens": 24})
    facts = r.model_extra["kv_transfer_params"]
    assert set(facts) == {"prefill_worker", "decode_worker", "kv_handoff", "num_cached_tokens"}, facts
    assert facts["decode_worker"] and facts["kv_handoff"] == (facts["prefill_worker"] != facts["decode_worker"])
    assert r.usage.prompt_tokens == 24
    same = client.completions.create(model=m, prompt=prompt[-24:], max_tokens=4, temperature=0)
    assert r.choices[0].text == same.choices[0].text
    choice = r.choices[0].model_extra
    assert choice["prompt_logprobs"] is None and choice["prompt_token_ids"] is None
    assert r.model_extra["kv_transfer_params"] is not None and same.model_extra["kv_transfer_params"] is None
    chat = client.chat.completions.create(model=m, messages=ASK, max_tokens=3, temperature=0)
    assert chat.model_extra["prompt_logprobs"] is None and chat.model_extra["prompt_token_ids"] is None
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=m, prompt="x", max_tokens=2, extra_body={"truncate_prompt_tokens": 100000})
    assert e.value.body["param"] == "truncate_prompt_tokens"
    asked = [17, 1234]
    lp = client.chat.completions.create(model=m, messages=ASK, max_tokens=4, temperature=0, logprobs=True,
                                        top_logprobs=1, extra_body={"logprob_token_ids": asked,
                                                                    "return_tokens_as_token_ids": True})
    for tok in lp.choices[0].logprobs.content:  # vLLM v0.33: the sampled token, then exactly the asked ids
        assert tok.token.startswith("token_id:"), tok
        tops = [t.token for t in tok.top_logprobs]
        assert tops[0] == tok.token and set(tops[1:]) == {f"token_id:{t}" for t in asked} - {tok.token}, tops
    bare = client.chat.completions.create(model=m, messages=ASK, max_tokens=2, temperature=0, logprobs=True,
                                          extra_body={"logprob_token_ids": asked})  # no top_logprobs: the same
    for tok in bare.choices[0].logprobs.content:
        assert [t.token for t in tok.top_logprobs][0] == tok.token and len(tok.top_logprobs) in (2, 3)
    text = client.completions.create(model=m, prompt="Hello", max_tokens=3, temperature=0, logprobs=5,
                                     extra_body={"logprob_token_ids": asked, "return_tokens_as_token_ids": True})
    for t, top in zip(text.choices[0].logprobs.tokens, text.choices[0].logprobs.top_logprobs):
        assert t.startswith("token_id:") and next(iter(top)) == t
        assert set(top) == {t, *(f"token_id:{a}" for a in asked)}, top


def _strict_json(text: str):
    """JSON as JavaScript, Go and serde read it: NaN and Infinity are refused."""
    def refuse(name):
        raise ValueError(f"non-finite number {name} in the response")

    return json.loads(text, parse_constant=refuse)


def test_every_logprob_option_at_once_answers_finite_json(served):
    """logprob_token_ids with allowed_token_ids (the asked ids are masked: their log-prob is
    -inf), top logprobs, prompt_logprobs and echo, streamed and not: a 200 whose every number is
    finite, -inf shown as vLLM shows it (-9999.0); it was a plain-text 500 (`Out of range float
    values are not JSON compliant`) and, streamed, `"logprob": -Infinity`."""
    _, server, _ = served
    base = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logprobs": 5, "logprob_token_ids": [5000],
            "allowed_token_ids": [42, 43], "prompt_logprobs": 2, "echo": True}
    chat = {"messages": ASK, "max_tokens": 3, "temperature": 0, "logprobs": True, "top_logprobs": 5,
            "logprob_token_ids": [5000], "allowed_token_ids": [42, 43], "prompt_logprobs": 2}
    for path, body in (("/v1/completions", base), ("/v1/chat/completions", chat)):
        r = httpx.post(server.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        doc = _strict_json(r.text)
        lp = doc["choices"][0]["logprobs"]
        if path == "/v1/completions":
            floors = [v for top in lp["top_logprobs"] if top for v in top.values() if v == -9999.0]
            assert floors, lp["top_logprobs"]  # token 5000, masked, at the floor
        else:
            tops = [t["logprob"] for tok in lp["content"] for t in tok["top_logprobs"]]
            assert -9999.0 in tops, tops
        with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=120) as s:
            assert s.status_code == 200
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
        assert events and all(_strict_json(e) is not None for e in events)
        assert any("-9999.0" in e for e in events), events[:3]


def test_vllm_server_flags_and_sagemaker_invocations(served):
    """vLLM's server-wide flags (router/options.py): --enable-force-include-usage (every stream
    ends with its usage), --return-tokens-as-token-ids (unless the request says otherwise),
    --enable-server-load-tracking (GET /load); and SageMaker's POST /invocations, which serves a
    chat or a completion by the body's shape. Off, /load is a 404 and a stream has no usage."""
    from pdserve.router.options import ServerOptions

    cluster, plain, _ = served
    s = Server(build_app(cluster, options=ServerOptions(force_include_usage=True, return_tokens_as_token_ids=True,
                                                        load_tracking=True)))
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
        m = model_of(c)
        chunks = list(c.completions.create(model=m, prompt="Hi", max_tokens=3, stream=True))
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
        lp = c.completions.create(model=m, prompt="Hi", max_tokens=2, logprobs=1).choices[0].logprobs
        assert all(t.startswith("token_id:") for t in lp.tokens)
        own = c.completions.create(model=m, prompt="Hi", max_tokens=2, logprobs=1,
                                   extra_body={"return_tokens_as_token_ids": False}).choices[0].logprobs
        assert not any(t.startswith("token_id:") for t in own.tokens)
        assert httpx.get(s.url + "/load").json() == {"server_load": 0}
        chat = httpx.post(s.url + "/invocations", json={"messages": ASK, "max_tokens": 2}, timeout=120).json()
        assert chat["object"] == "chat.completion", chat
        text = httpx.post(s.url + "/invocations", json={"prompt": "Hi", "max_tokens": 2}, timeout=120).json()
        assert text["object"] == "text_completion", text
    finally:
        s.stop()
    assert httpx.get(plain.url + "/load").status_code == 404
    plain_client = openai.OpenAI(base_url=plain.url + "/v1", api_key="none", max_retries=0)
    assert all(ch.usage is None for ch in plain_client.completions.create(model=m, prompt="Hi", max_tokens=3,
                                                                          stream=True))


def test_vllm_error_messages_name_what_is_wrong(served):
    _, _, client = served
    m = model_of(client)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=m, prompt="x", max_tokens=2, logit_bias={"abc": 1})
    assert "'abc'" in e.value.body["message"] and e.value.body["param"] == "logit_bias"
    with pytest.raises(openai.BadRequestError) as e:  # every bad key and value named, not the first
        client.completions.create(model=m, prompt="x", max_tokens=2, logit_bias={"abc": 1, "xyz": 2, "-3": 1})
    assert all(k in e.value.body["message"] for k in ("'abc'", "'xyz'", "'-3': 1")), e.value.body
    with pytest.raises(openai.BadRequestError) as e:  # every out-of-vocabulary id named
        client.completions.create(model=m, prompt="x", max_tokens=2,
                                  logit_bias={str(99999990 + i): 1 for i in range(8)})
    assert all(str(99999990 + i) in e.value.body["message"] for i in range(8)), e.value.body
    for seed, kind in ((1 << 70, "less_than_equal"), (-(1 << 70), "greater_than_equal")):  # pydantic's type kept
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=m, prompt="x", max_tokens=2, seed=seed)
        assert kind in e.value.body["message"] and e.value.body["param"] == "seed", e.value.body
    asks = ((dict(prompt="x", logit_bias={"99999999": 1}), "logit_bias"), (dict(prompt=[99999999]), "prompt"),
            (dict(prompt="x", logprobs=1, extra_body={"logprob_token_ids": [99999999]}), "logprob_token_ids"))
    for kw, param in asks:
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=m, max_tokens=2, **kw)
        # vLLM's clients look for the vocabulary's size (SmolLM2's 49152) in the message
        assert "out of vocabulary (vocabulary size 49152" in e.value.body["message"], kw
        assert e.value.body["param"] == param, kw
    # the real problem named, not the first branch pydantic tried ("Input should be a valid string")
    for prompt, words in (([], "prompt is empty"), ([-1], "out of vocabulary (vocabulary size 49152: ids 0..49151)"),
                          ([[5, 6], []], "prompt is empty")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=m, prompt=prompt, max_tokens=2)
        assert words in e.value.body["message"] and e.value.body["param"] == "prompt", (prompt, e.value.body)
    with pytest.raises(openai.BadRequestError) as e:  # the missing field by its path, not only "tools"
        client.chat.completions.create(model=m, messages=ASK, max_tokens=2, tools=[{"type": "function"}])
    assert "'tools[0].function': Field required" in e.value.body["message"], e.value.body
    assert e.value.body["param"] == "tools"


def test_tokenize_takes_the_chat_options_and_tokenizer_info(served):
    cluster, server, _ = served
    msgs = ASK + [{"role": "assistant", "content": "It is sunny"}]
    base = httpx.post(server.url + "/tokenize", json={"messages": msgs}).json()
    cont = httpx.post(server.url + "/tokenize", json={"messages": msgs, "continue_final_message": True,
                                                     "add_generation_prompt": False, "return_token_strs": True}).json()
    assert cont["tokens"] != base["tokens"] and len(cont["token_strs"]) == cont["count"]
    assert cluster.tokenizer.decode(cont["tokens"]).rstrip().endswith("It is sunny")
    assert cont["token_strs"] == cluster.tokenizer.convert_ids_to_tokens(cont["tokens"])
    tools = httpx.post(server.url + "/tokenize", json={"messages": ASK, "tools": [WEATHER]}).json()
    chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "tools": [WEATHER],
                                                                "tool_choice": "none", "max_tokens": 1}).json()
    assert tools["count"] == chat["usage"]["prompt_tokens"]  # the prompt the chat completion runs
    bad_tool = httpx.post(server.url + "/tokenize", json={"messages": ASK, "tools": [{"type": "function"}]})
    assert bad_tool.status_code == 400 and bad_tool.json()["error"]["param"] == "tools"
    bad = httpx.post(server.url + "/tokenize", json={"messages": ASK, "continue_final_message": True,
                                                    "add_generation_prompt": False})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "continue_final_message"
    info = httpx.get(server.url + "/tokenizer_info").json()
    assert info["tokenizer_class"] == type(cluster.tokenizer).__name__ and info["chat_template"]
    assert info["vocab_size"] == len(cluster.tokenizer) and json.dumps(info)


def test_serving_under_a_root_path(served):
    """--root-path: behind a proxy that keeps the prefix the routes answer under it, and where it
    strips the prefix, as before; the admin guard sees the same path the routes do."""
    cluster, _, _ = served
    s = Server(build_app(cluster, api_key="k", admin_key="a", root_path="/llm"))
    try:
        auth = {"Authorization": "Bearer k"}
        for path in ("/llm/v1/models", "/v1/models"):
            r = httpx.get(s.url + path, headers=auth)
            assert r.status_code == 200 and r.json()["data"][0]["id"] == "SmolLM2-135M-Instruct", path
        assert httpx.get(s.url + "/llm/v1/models").status_code == 401
        assert httpx.get(s.url + "/llm/admin/status", headers=auth).status_code == 401  # the admin key, not k
        assert httpx.get(s.url + "/llm/health").status_code == 200
        client = openai.OpenAI(base_url=s.url + "/llm/v1", api_key="k", max_retries=0)
        assert client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2).choices
    finally:
        s.stop()


def scrape(url: str) -> dict:
    text = httpx.get(url + "/metrics").text
    return {s.name + json.dumps(s.labels, sort_keys=True): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def total(d: dict, name: str) -> float:
    return sum(v for k, v in d.items() if k.startswith(name + "{"))


def test_the_metrics_a_vllm_dashboard_reads(served):
    """iteration_tokens_total counts every prompt token computed and every token sampled (the
    prefill step's too); inter-token latency is observed per token (10 requests x 10 tokens: 90);
    request_num_preemptions per request; waiting by reason; the cache's size in tokens and its
    concurrency; admission rejections; the running gauge settles when the request finishes."""
    cluster, server, client = served
    m = model_of(client)
    rng = random.Random(11)
    time.sleep(1.5)  # the monitor's stats of earlier tests' steps
    before = scrape(server.url)
    for _ in range(10):
        client.completions.create(model=m, prompt=[rng.randrange(100, 40000) for _ in range(40)], max_tokens=10,
                                  temperature=0, extra_body={"ignore_eos": True})
    after = scrape(server.url)
    for name in ("vllm:num_requests_running", "pdserve:cluster_num_requests_running"):
        assert total(after, name) == 0, (name, {k: v for k, v in after.items() if k.startswith(name)})
    assert total(after, "vllm:inter_token_latency_seconds_count") - \
        total(before, "vllm:inter_token_latency_seconds_count") == 90
    preempt = "vllm:request_num_preemptions_count"
    assert total(after, preempt) - total(before, preempt) == 10
    deadline = time.monotonic() + 10
    while True:  # worker stats come with the monitor's next round
        time.sleep(1.1)
        after = scrape(server.url)
        grew = total(after, "vllm:iteration_tokens_total_sum") - total(before, "vllm:iteration_tokens_total_sum")
        if grew >= 500 or time.monotonic() > deadline:
            break
    assert grew == 10 * (40 + 10), grew
    reasons = {json.loads(k[k.index("{"):])["reason"] for k in after
               if k.startswith("vllm:num_requests_waiting_by_reason{")}
    assert reasons == {"capacity", "deferred"}
    info = [json.loads(k[k.index("{"):]) for k in after if k.startswith("vllm:cache_config_info{")]
    assert info and all(int(i["kv_cache_size_tokens"]) == int(i["num_gpu_blocks"]) * 16 and
                        float(i["kv_cache_max_concurrency"]) == pytest.approx(int(i["kv_cache_size_tokens"]) / 512,
                                                                              abs=0.01) for i in info)
    busy = Server(build_app(cluster, max_queue=1))
    try:
        admitted = threading.Event()

        def hold():  # one streamed request holds the only slot from its first chunk to its end
            with httpx.stream("POST", busy.url + "/v1/completions", timeout=60, json={
                    "prompt": "Hello", "max_tokens": 200, "ignore_eos": True, "stream": True}) as resp:
                for _ in resp.iter_lines():
                    admitted.set()

        holder = threading.Thread(target=hold)
        holder.start()
        assert admitted.wait(30)
        r = httpx.post(busy.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 429, r.text
        holder.join(60)
        rej = scrape(busy.url)
        key = "vllm:admission_rejections_total" + json.dumps({"model_name": "SmolLM2-135M-Instruct",
                                                              "reason": "queue_full"}, sort_keys=True)
        assert rej[key] >= 1
    finally:
        busy.stop()


def test_the_admin_cli_and_the_bench_find_the_server_as_a_client_does(served, capsys):
    """`pdserve status --url .../v1` (the OpenAI base URL, which `pdserve bench --url` takes)
    reaches the same server; `pdserve bench` measures attainment against the server's own SLO."""
    import argparse

    from pdserve.bench import slo_targets
    from pdserve.bench.client import Endpoint
    from pdserve.cli import main

    cluster, server, _ = served
    assert main(["status", "--url", server.url + "/v1"]) == 0
    assert "decode" in capsys.readouterr().out
    ep = Endpoint(server.url + "/v1")
    assert ep.slo() == cluster.slo() and cluster.slo()["tpot_s"] == 0.05
    unset = argparse.Namespace(slo_ttft=None, slo_tpot=None)
    assert slo_targets(unset, ep.slo()) == (cluster.slo()["ttft_s"], 0.05)
    assert slo_targets(unset, None) == (2.0, 0.05)  # not a pdserve server: `pdserve serve`'s default
    assert slo_targets(argparse.Namespace(slo_ttft=1.0, slo_tpot=0.02), ep.slo()) == (1.0, 0.02)
