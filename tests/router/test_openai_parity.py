"""OpenAI and vLLM clients unchanged, against the real server (uvicorn, a real Ray cluster,
the official `openai` client) in two modes: disaggregated (the prompt's log-probs cross the
handoff with its KV) and colocated. Batched prompts, the prompt's log-probs (echo and vLLM's
prompt_logprobs), logprobs=0, vLLM's structured_outputs and extras, tools whose parameters
use $defs, and the refusals vLLM makes."""

from __future__ import annotations

import json
import math
import re
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel

from pdserve import LLM, SamplingParams
from pdserve.cluster import Cluster
from pdserve.engine.sample.structured import regex_literal
from pdserve.router.app import build_app

from helpers import Server

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("shared_ray")]  # a real-model or multi-actor cluster per module

PROMPTS = ["Hello, my name is", "The capital of France is"]
# tool_choice auto's call format, per server
PARSER = {"disaggregated": "hermes", "colocated": "mistral"}
MORE_PARSERS = {"colocated": ("llama3_json",)}  # on a second router over the same cluster
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# hybrid mode serves each prompt by one of these two paths (its placement: test_hybrid.py)
@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def served(request, shared_ray):
    kw = dict(decode=1, mode=request.param, **({} if request.param == "colocated" else {"prefill": 1}))
    c = Cluster.start(max_model_len=512, **kw)
    s = Server(build_app(c, tool_call_parser=PARSER[request.param]))
    yield c, s, openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0)
    s.stop()
    c.shutdown()


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=512)


def model_of(client) -> str:
    return client.models.list().data[0].id


def test_batched_prompts_are_one_choice_per_prompt_and_copy(served, llm):
    """prompt = [text, text] and [[ids], [ids]], n = 2: choice index prompt i x n + copy j,
    each equal to the engine's, usage summed; streamed, each index's text equals it too."""
    _, _, client = served
    ref = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=6))
    want = [o.outputs[0].text for o in ref]
    r = client.completions.create(model=model_of(client), prompt=PROMPTS, n=2, max_tokens=6, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [want[0], want[0], want[1], want[1]]
    ids = [llm.engine.tokenizer.encode(p) for p in PROMPTS]
    assert r.usage.prompt_tokens == sum(map(len, ids))
    assert r.usage.completion_tokens == 2 * sum(len(o.outputs[0].token_ids) for o in ref)
    by_ids = client.completions.create(model=model_of(client), prompt=ids, max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == want
    text = {}
    for ch in client.completions.create(model=model_of(client), prompt=PROMPTS, n=2, max_tokens=6, temperature=0,
                                        stream=True):
        for c in ch.choices:
            text[c.index] = text.get(c.index, "") + c.text
    assert text == {0: want[0], 1: want[0], 2: want[1], 3: want[1]}


def test_echo_with_logprobs_scores_the_prompt(served, llm):
    """echo + logprobs (how lm-evaluation-harness scores text): the prompt's tokens come first,
    the first with no log-prob, the others equal to the engine's prompt_logprobs (computed
    where the prompt is prefilled, carried across the handoff); streamed, the first chunk
    carries them. vLLM's prompt_logprobs field gives the same numbers with ranks."""
    _, _, client = served
    prompt = PROMPTS[1]
    ref = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1, logprobs=1))[0]
    ids = ref.prompt_token_ids
    r = client.completions.create(model=model_of(client), prompt=prompt, max_tokens=2, temperature=0, echo=True,
                                  logprobs=1)
    lp = r.choices[0].logprobs
    n = len(ids)
    assert len(lp.tokens) == n + 2 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:n] == pytest.approx([ref.prompt_logprobs[i][ids[i]] for i in range(1, n)], abs=2e-3)
    assert r.choices[0].text.startswith(prompt) and "".join(lp.tokens[n:]) == r.choices[0].text[len(prompt):]
    assert all(top[tok] == pytest.approx(v) for tok, v, top in zip(lp.tokens[1:], lp.token_logprobs[1:],
                                                                    lp.top_logprobs[1:]))
    # each dict starts with the actual token, echoed or sampled (vLLM's order)
    assert all(next(iter(top)) == tok for tok, top in zip(lp.tokens[1:], lp.top_logprobs[1:]))
    chunks = list(client.completions.create(model=model_of(client), prompt=prompt, max_tokens=2, temperature=0,
                                            echo=True, logprobs=1, stream=True))
    head = chunks[0].choices[0]
    assert head.text == prompt and head.logprobs.token_logprobs == pytest.approx(lp.token_logprobs[:n], abs=1e-6)
    alone = client.completions.create(model=model_of(client), prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    assert alone.choices[0].text == prompt and alone.usage.completion_tokens == 0  # scoring: the prompt alone
    assert alone.choices[0].finish_reason == "length" and alone.choices[0].logprobs.token_logprobs == \
        pytest.approx(lp.token_logprobs[:n], abs=1e-6)
    for bad in (dict(prompt=prompt, max_tokens=0), dict(prompt=prompt, max_tokens=0, logprobs=1)):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model=model_of(client), **bad)
        assert e.value.body["param"] == "max_tokens"
    v = client.completions.create(model=model_of(client), prompt=prompt, max_tokens=2, temperature=0,
                                  extra_body={"prompt_logprobs": 2}).choices[0].model_extra["prompt_logprobs"]
    assert v[0] is None and len(v) == n
    for i in range(1, n):
        mine = v[i][str(ids[i])]
        assert mine["logprob"] == pytest.approx(ref.prompt_logprobs[i][ids[i]], abs=2e-3)
        assert mine["rank"] == ref.prompt_ranks[i]  # among the whole vocabulary
        ranked = sorted(v[i].values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in ranked][:2] == [1, 2] and len({e["rank"] for e in ranked}) == len(ranked)
        assert [e["logprob"] for e in ranked] == sorted((e["logprob"] for e in ranked), reverse=True)
    chat = client.chat.completions.create(model=model_of(client), messages=[{"role": "user", "content": "Hi"}],
                                          max_tokens=2, extra_body={"prompt_logprobs": 0, "return_token_ids": True})
    extra = chat.model_extra
    assert extra["prompt_logprobs"][0] is None and len(extra["prompt_logprobs"]) == len(extra["prompt_token_ids"])
    assert all(math.isfinite(next(iter(e.values()))["logprob"]) for e in extra["prompt_logprobs"][1:])


def test_logprobs_zero_gives_the_sampled_token(served):
    """logprobs=0: each top_logprobs entry holds the sampled token (OpenAI and vLLM)."""
    _, _, client = served
    lp = client.completions.create(model=model_of(client), prompt=PROMPTS[0], max_tokens=4, temperature=0,
                                   logprobs=0).choices[0].logprobs
    assert [list(t) for t in lp.top_logprobs] == [[tok] for tok in lp.tokens]
    assert [t[tok] for t, tok in zip(lp.top_logprobs, lp.tokens)] == lp.token_logprobs


def test_vllm_structured_outputs_and_extras(served, llm):
    """vLLM's structured_outputs (choice, regex, json, grammar), guided_grammar, return_token_ids,
    allowed_token_ids, continuous usage, prompt_tokens_details and the chat extras
    (chat_template_kwargs, continue_final_message with echo)."""
    cluster, _, client = served
    m = model_of(client)
    ask = [{"role": "user", "content": "Is the sky blue? Answer yes or no."}]
    choice = client.chat.completions.create(model=m, messages=ask, max_tokens=5,
                                            extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no")
    regex = client.completions.create(model=m, prompt="Phone:", max_tokens=12,
                                      extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    assert len(regex.choices[0].text) == 8 and regex.choices[0].text[3] == "-"
    person = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"],
              "additionalProperties": False}
    doc = client.chat.completions.create(model=m, messages=[{"role": "user", "content": "A person as JSON"}],
                                         max_tokens=120, temperature=0.8, seed=1,
                                         extra_body={"structured_outputs": {"json": person}})
    assert doc.choices[0].finish_reason == "stop" and isinstance(json.loads(doc.choices[0].message.content)["age"], int)
    yes_no = 'root ::= "yes" | "no"'
    for body in ({"structured_outputs": {"grammar": yes_no}}, {"guided_grammar": yes_no}):
        g = client.chat.completions.create(model=m, messages=ask, max_tokens=5, extra_body=body)
        assert g.choices[0].message.content in ("yes", "no")
    for bad, param in (({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
                       ({"structured_outputs": {"grammar": "root ::= ("}}, "structured_outputs"),
                       ({"structured_outputs": {"yaml": "x"}}, "structured_outputs")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=m, messages=ask, max_tokens=5, extra_body=bad)
        assert e.value.body["param"] == param, (bad, e.value.body)
    allowed = llm.engine.tokenizer.encode(" yes no maybe")
    r = client.completions.create(model=m, prompt=PROMPTS[0], max_tokens=6, temperature=1.0, seed=3,
                                  extra_body={"allowed_token_ids": allowed, "return_token_ids": True})
    extra = r.choices[0].model_extra
    assert set(extra["token_ids"]) <= set(allowed) and len(extra["token_ids"]) == 6
    assert extra["prompt_token_ids"] == llm.engine.tokenizer.encode(PROMPTS[0])
    usages = [ch.usage for ch in client.completions.create(
        model=m, prompt=PROMPTS[0], max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}) if ch.usage]
    assert len(usages) >= 5 and usages[-1].completion_tokens == 5
    assert [u.completion_tokens for u in usages] == sorted(u.completion_tokens for u in usages)
    long = PROMPTS[1] + " " + "and so on, " * 20
    client.completions.create(model=m, prompt=long, max_tokens=2, temperature=0)
    again = client.completions.create(model=m, prompt=long, max_tokens=2, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens >= 16
    partial = [{"role": "user", "content": "Name a fruit."}, {"role": "assistant", "content": "The fruit is"}]
    cont = client.chat.completions.create(model=m, messages=partial, max_tokens=4, temperature=0, extra_body={
        "continue_final_message": True, "add_generation_prompt": False, "echo": True, "return_token_ids": True,
        "chat_template_kwargs": {"enable_thinking": False}})
    want = llm.get_tokenizer().apply_chat_template(partial, continue_final_message=True, tokenize=True,
                                                    return_dict=False)
    assert cont.model_extra["prompt_token_ids"] == list(want)
    assert cont.choices[0].message.content.startswith("The fruit is")
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=m, messages=partial, max_tokens=4,
                                       extra_body={"continue_final_message": True})
    assert e.value.body["param"] == "continue_final_message"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=m, messages=ask, max_tokens=4,
                                       extra_body={"chat_template_kwargs": {"tokenize": False}})
    assert e.value.body["param"] == "chat_template_kwargs"


class Address(BaseModel):
    city: str
    country: str


class Person(BaseModel):
    name: str
    home: Address


def test_streamed_token_ids_are_every_id_once_in_order(served):
    """vLLM's return_token_ids in a stream: the chunks carry every id once, in order, as the whole
    answer has them, also where the text holds a character's first bytes back or a stop token
    adds no text."""
    _, _, client = served
    m = model_of(client)
    body = {"structured_outputs": {"choice": ["\U0001f4a1\U0001f4ac\U0001f4b0"]}, "return_token_ids": True}
    ask = [{"role": "user", "content": "Three emoji, please."}]
    for chat in (False, True):
        kw = dict(model=m, max_tokens=16, temperature=0, extra_body=body)
        create = (lambda **k: client.chat.completions.create(messages=ask, **k)) if chat else \
            (lambda **k: client.completions.create(prompt=PROMPTS[0], **k))
        whole = create(**kw).choices[0]
        want = whole.model_extra["token_ids"]
        text = whole.message.content if chat else whole.text
        assert text == "\U0001f4a1\U0001f4ac\U0001f4b0" and len(want) > 3, (text, want)
        chunks = [c for ch in create(stream=True, **kw) for c in ch.choices]
        got = [t for c in chunks for t in (c.model_extra or {}).get("token_ids") or []]
        assert got == want, (chat, got, want)
        silent = [c for c in chunks if (c.model_extra or {}).get("token_ids") and
                  not (c.delta.content if chat else c.text)]
        assert silent, chunks  # ids without text: what lost them before


def test_structured_output_with_the_openai_client(served, request):
    """response_format json_schema / json_object and vLLM's guided_choice / guided_regex, across
    the handoff (the prefill worker samples the first token under the grammar, the decode worker
    replays it into its own matcher): the output parses and validates; a bad grammar is a 400.
    The disaggregated cluster's model, which closes its JSON (a random model fills the grammar's
    whitespace until max_tokens)."""
    if request.node.callspec.params["served"] != "disaggregated":
        pytest.skip("the handoff's grammar replay: disaggregated only")
    cluster, _, client = served
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    ask = [{"role": "user", "content": "A city and its population, as JSON."}]
    out = client.chat.completions.create(model=model_of(client), messages=ask, max_tokens=80, temperature=0.7,
                                         seed=3, response_format={"type": "json_schema", "json_schema": {
                                             "name": "city", "schema": schema, "strict": True}})
    doc = json.loads(out.choices[0].message.content)
    assert set(doc) == {"city", "population"} and isinstance(doc["population"], int)
    streamed = client.chat.completions.create(model=model_of(client), messages=ask, max_tokens=80, temperature=0.7,
                                              seed=4, response_format={"type": "json_object"}, stream=True)
    text = "".join(ch.choices[0].delta.content or "" for ch in streamed if ch.choices)
    assert isinstance(json.loads(text), dict)
    pick = client.completions.create(model=model_of(client), prompt="Favourite colour:", max_tokens=8,
                                     extra_body={"guided_choice": ["red", "green", "blue"]})
    assert pick.choices[0].text in {"red", "green", "blue"}
    num = client.completions.create(model=model_of(client), prompt="A phone number:", max_tokens=12,
                                    extra_body={"guided_regex": "[0-9]{3}-[0-9]{4}"})
    assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", num.choices[0].text)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_of(client), prompt="x", max_tokens=4,
                                  extra_body={"guided_regex": "(("})
    assert e.value.body["param"] == "guided_regex"  # the field the grammar came from
    deadline = time.monotonic() + 20
    while any(r["request_blocks"] or r["inflight"] for r in cluster.status()):
        assert time.monotonic() < deadline, cluster.status()
        time.sleep(0.2)


WEATHER_UNIT = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"],
    "additionalProperties": False}}}


def test_tool_calls_with_the_openai_client(served, request):
    """tools with tool_choice named or "required" (router/tools.py): the reply is tool calls whose
    arguments validate against the tool's schema, streamed too; "none" is text; an earlier
    turn's calls and the tool's answer are accepted in the conversation (the 400s:
    test_router.py). On the disaggregated
    cluster's model, which closes its calls (a random model fills the grammar's whitespace)."""
    if request.node.callspec.params["served"] != "disaggregated":
        pytest.skip("once: the router's tool handling, whatever the mode")
    cluster, _, client = served
    ask = [{"role": "user", "content": "What is the weather in Paris?"}]
    kw = dict(model=model_of(client), messages=ask, max_tokens=60, temperature=0, tools=[WEATHER_UNIT, CLOCK])
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_weather"}}, **kw)
    call = named.choices[0].message.tool_calls[0]
    args = json.loads(call.function.arguments)
    assert named.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert args["city"] in {"Paris", "Rome", "Oslo"} and args["unit"] in {"celsius", "fahrenheit"}
    assert call.id.startswith("call_") and named.choices[0].message.content is None
    required = client.chat.completions.create(tool_choice="required", parallel_tool_calls=False, **kw)
    calls = required.choices[0].message.tool_calls
    assert len(calls) == 1 and calls[0].function.name in {"get_weather", "get_time"}
    assert set(json.loads(calls[0].function.arguments)) in ({"city", "unit"}, {"zone"})
    streamed = client.chat.completions.create(tool_choice="required", stream=True, **kw)
    deltas = [d for ch in streamed for d in (ch.choices[0].delta.tool_calls or []) if ch.choices]
    assert deltas and all(json.loads(d.function.arguments) is not None for d in deltas)
    text = client.chat.completions.create(tool_choice="none", **kw)
    assert text.choices[0].message.tool_calls is None and text.choices[0].message.content
    history = ask + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function",
         "function": {"name": "get_weather", "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21}'}]
    reply = client.chat.completions.create(model=model_of(client), messages=history, max_tokens=8, temperature=0)
    assert reply.choices[0].message.content
    deadline = time.monotonic() + 20
    while any(r["request_blocks"] or r["inflight"] for r in cluster.status()):
        assert time.monotonic() - deadline < 0, cluster.status()
        time.sleep(0.2)


def test_required_tools_with_defs_in_their_parameters(served):
    """A tool whose parameters use $defs / $ref (pydantic's model_json_schema()) works with
    tool_choice "required" as with a named choice: the call validates against the model."""
    _, _, client = served
    tool = {"type": "function", "function": {"name": "add_person", "parameters": Person.model_json_schema()}}
    other = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}
    r = client.chat.completions.create(model=model_of(client), max_tokens=80, temperature=0, tools=[tool, other],
                                       tool_choice="required", parallel_tool_calls=False,
                                       messages=[{"role": "user", "content": "Add Ana from Lyon, France."}])
    call = r.choices[0].message.tool_calls[0]
    if call.function.name == "add_person":
        Person.model_validate_json(call.function.arguments)
    assert r.choices[0].finish_reason == "tool_calls"


def test_refusals_vllm_makes(served):
    """stream_options without stream, a JSON body sent as a form, are 4xx naming the problem."""
    _, server, client = served
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_of(client), prompt="x", max_tokens=2,
                                  stream_options={"include_usage": True})
    assert e.value.body["param"] == "stream_options"
    form = httpx.post(server.url + "/v1/completions", content=json.dumps({"prompt": "x", "max_tokens": 2}),
                      headers={"Content-Type": "application/x-www-form-urlencoded"})
    assert form.status_code == 415 and "application/json" in form.json()["error"]["message"]
    bad = httpx.get(server.url + "/admin/timeline?n=abc")
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "n"


def test_auto_tool_choice_parses_the_models_call_format(served):
    """tool_choice "auto" (the default once tools are given) with each call-format parser: a
    reply in the model's call format (forced here by a regex, since the default model rarely
    calls) comes back as tool_calls and its text as content, streamed as content deltas then a
    tool_calls delta; a reply without a call is plain content."""
    cluster, _, client = served
    check_auto_tool_choice(client, PARSER[cluster.mode])
    for fmt in MORE_PARSERS.get(cluster.mode, ()):
        s = Server(build_app(cluster, tool_call_parser=fmt))
        try:
            check_auto_tool_choice(openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0), fmt)
        finally:
            s.stop()


def check_auto_tool_choice(client, fmt: str) -> None:
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = {"hermes": f"Checking.\n<tool_call>\n{call}\n</tool_call>", "mistral": f"Checking.[TOOL_CALLS][{call}]",
            "llama3_json": call.replace("arguments", "parameters")}[fmt]
    said = None if fmt == "llama3_json" else "Checking."  # llama3_json: the reply is the call alone
    kw = dict(model=model_of(client), messages=[{"role": "user", "content": "Weather in Paris?"}], max_tokens=120,
              temperature=0,
              tools=[WEATHER], extra_body={"structured_outputs": {"regex": regex_literal(text)}})
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and msg.content == said, fmt
    assert [(c.function.name, json.loads(c.function.arguments)) for c in msg.tool_calls] == \
        [("get_weather", {"city": "Paris"})]
    chunks = [ch.choices[0] for ch in client.chat.completions.create(stream=True, **kw) if ch.choices]
    content = "".join(c.delta.content or "" for c in chunks)
    calls = [t for c in chunks for t in (c.delta.tool_calls or [])]
    assert content.startswith(said or "") and len(calls) == 1 and calls[0].function.name == "get_weather"
    assert chunks[-1].finish_reason == "tool_calls"
    sunny = {"structured_outputs": {"regex": regex_literal("Sunny, 21 C.")}}
    plain = client.chat.completions.create(**{**kw, "extra_body": sunny})
    assert plain.choices[0].message.content == "Sunny, 21 C." and plain.choices[0].message.tool_calls is None
    assert plain.choices[0].finish_reason == "stop"


def test_vllm_request_metrics(served):
    """The request-level series vLLM's dashboard reads, in both modes: token counts, n and
    max_tokens, queue / prefill / decode / inference times (from the worker that first stepped
    the request), tokens per step, the cache's configuration, and cluster-wide running/waiting."""
    _, server, client = served

    def scrape():
        text = httpx.get(server.url + "/metrics").text
        return {s.name + json.dumps(s.labels, sort_keys=True): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    def total(d, name):
        return sum(v for k, v in d.items() if k.startswith(name + "{"))

    before = scrape()
    client.completions.create(model=model_of(client), prompt=PROMPTS[0], n=2, max_tokens=5, temperature=0.7,
                              extra_body={"ignore_eos": True})
    time.sleep(1.5)  # worker stats refresh every second
    after = scrape()
    grew = {n: total(after, n) - total(before, n) for n in (
        "vllm:request_params_n_sum", "vllm:request_params_max_tokens_sum", "vllm:request_prompt_tokens_count",
        "vllm:request_generation_tokens_sum", "vllm:request_queue_time_seconds_count",
        "vllm:request_prefill_time_seconds_count", "vllm:request_decode_time_seconds_count",
        "vllm:request_inference_time_seconds_count", "vllm:iteration_tokens_total_count")}
    assert grew["vllm:request_params_n_sum"] == 2 and grew["vllm:request_params_max_tokens_sum"] == 5, grew
    assert grew["vllm:request_prompt_tokens_count"] == 2 and grew["vllm:request_generation_tokens_sum"] == 10, grew
    for name in ("queue", "prefill", "decode", "inference"):
        assert grew[f"vllm:request_{name}_time_seconds_count"] == 2, (name, grew)
    assert grew["vllm:iteration_tokens_total_count"] >= 5, grew
    info = [k for k in after if k.startswith("vllm:cache_config_info{")]
    assert info and all('"block_size": "16"' in k for k in info)
    assert total(after, "pdserve:cluster_num_requests_running") == 0
    assert "pdserve:cluster_num_requests_waiting" + json.dumps({"model_name": model_of(client)}) in after
