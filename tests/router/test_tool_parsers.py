"""tool_choice "auto"'s parsers (router/tool_parsers.py) on the formats each model family writes:
calls and content out of a finished reply, what a stream may send before a call can begin, and
text that only looks like a call staying text."""

from __future__ import annotations

import pytest

from pdserve.router.tool_parsers import PARSERS

WEATHER = ("get_weather", {"city": "Paris"})
TIME = ("get_time", {"zone": "UTC"})


@pytest.mark.parametrize("name, text, content, calls", [
    ("hermes", 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
               '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>', "Let me look.",
     [WEATHER, TIME]),
    ("hermes", '<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}</tool_call>', None,
     [WEATHER]),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_time", "parameters": {"zone": "UTC"}}', None, [WEATHER, TIME]),
    ("llama3_json", ' {"name": "get_weather", "arguments": {"city": "Paris"}}', None, [WEATHER]),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, '
                '{"name": "get_time", "arguments": {"zone": "UTC"}}]', "Sure.", [WEATHER, TIME]),
    ("mistral", '[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, [WEATHER]),
])
def test_calls_and_content(name, text, content, calls):
    assert PARSERS[name].parse(text) == (content, calls)


@pytest.mark.parametrize("name, text", [
    ("hermes", "It is sunny."), ("hermes", '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'),
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>'), ("llama3_json", "It is {sunny}."),
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}} and more'),
    ("mistral", "[1, 2, 3]"), ("mistral", '[TOOL_CALLS][{"name": "get_weather"'),
])
def test_text_that_is_not_a_whole_call_stays_text(name, text):
    assert PARSERS[name].parse(text) == (text, [])


def test_what_a_stream_may_send_before_a_call_can_begin():
    h, ll, m = PARSERS["hermes"], PARSERS["llama3_json"], PARSERS["mistral"]
    assert h.streamable("Let me look.") == 12
    assert h.streamable("Let me look. <tool") == 13  # "<tool" may begin the marker: held
    assert h.streamable("Let me look. <tool_call>{") == 13
    assert h.streamable("a < b") == 5
    assert ll.streamable("") == ll.streamable("  {") == ll.streamable("<|py") == 0  # may be a call
    assert ll.streamable("It is sunny.") == 12
    assert m.streamable("[") == 0 and m.streamable("Sure.[TOOL") == 5 and m.streamable("Sure.") == 5
