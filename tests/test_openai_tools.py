"""Tool calls without a server: `tools`/`tool_choice` checked (each bad one a 400 naming the field), the grammar a
required or named choice puts on the output (compiled by the real grammar engine on the real tokenizer, and the
documents it accepts), the model's text read back as calls, streamed text held only while it may be a call, and
the generic tool format's conversation. Through a real server with the openai client: tests/test_openai_api.py."""
from __future__ import annotations

import json

import pytest

from spork_trt.serving.openai_api.errors import ApiError
from spork_trt.serving.openai_api.generic_tools import generic_messages
from spork_trt.serving.openai_api.messages import messages
from spork_trt.serving.openai_api.tools import Held, parse_tools, read_calls

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"$ref": "#/$defs/zone"}}, "required": ["zone"],
    "$defs": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}}}}


def refused(body: dict, param: str, needle: str = "") -> None:
    with pytest.raises(ApiError) as e:
        parse_tools(body)
    assert e.value.status == 400 and e.value.param == param and needle in e.value.message, e.value.message


def test_tool_choice_picks_the_grammar():
    assert parse_tools({}) is None and parse_tools({"tools": [], "tool_choice": "auto"}) is None
    auto = parse_tools({"tools": [WEATHER, TIME]})
    assert auto.choice == "auto" and auto.grammar is None and auto.names == ("get_weather", "get_time")
    assert parse_tools({"tools": [WEATHER], "tool_choice": "none"}).reads_calls is False
    required = json.loads(parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}).grammar.source)
    assert [o["properties"]["name"]["const"] for o in required["anyOf"]] == ["get_weather", "get_time"]
    assert required["$defs"] == {"get_time.zone": {"type": "string", "enum": ["UTC", "CET"]}}  # hoisted, renamed
    assert required["anyOf"][1]["properties"]["arguments"]["properties"]["zone"] == {"$ref": "#/$defs/get_time.zone"}
    named = json.loads(parse_tools({"tools": [WEATHER, TIME], "tool_choice": {"type": "function", "function": {
        "name": "get_weather"}}}).grammar.source)
    assert named["properties"]["name"] == {"const": "get_weather"} and "anyOf" not in named


@pytest.mark.parametrize("body,param,needle", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": {"a": 1}}, "tools", "must be a list"),
    ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "two tools are named 'get_weather'"),
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name", "1 to 64 letters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]", '"type": "function"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, "tools[0].function",
     "parameters (a JSON schema object)"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope', which is not one of the tools (get_weather)"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", '"required"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"$ref": "http://x/s.json"}}}],
      "tool_choice": "required"}, "tools", "only refs to its own $defs"),
    ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
])
def test_bad_tools_are_400s_naming_the_field(body, param, needle):
    refused(body, param, needle)


def test_required_grammar_compiles_and_holds_calls_to_the_schema(default_tokenizer):
    """The real grammar engine on the real tokenizer: a call of the tool with valid arguments is accepted whole,
    one with a wrong enum value or an unknown name is not."""
    from spork_trt.spec.grammar import Grammars

    grammars = Grammars(default_tokenizer.hf, 49152, default_tokenizer.eos_ids)
    spec = parse_tools({"tools": [WEATHER, TIME], "tool_choice": "required"}).grammar
    compiled = grammars.compiled(spec)

    def accepts(doc: str) -> bool:
        import xgrammar

        m = xgrammar.GrammarMatcher(compiled)
        return m.accept_string(doc) and m.accept_token(next(iter(default_tokenizer.eos_ids)))  # whole: it may end
    assert accepts('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}')
    assert accepts('{"name": "get_time", "arguments": {"zone": "UTC"}}')
    assert not accepts('{"name": "get_weather", "arguments": {"city": "Paris", "unit": "kelvin"}}')
    assert not accepts('{"name": "get_tide", "arguments": {}}')
    assert not accepts('{"name": "get_time", "arguments": {"zone": "UTC"}')  # unfinished: it may not end


def test_text_reads_back_as_calls_only_when_all_of_it_is_calls():
    tools = parse_tools({"tools": [WEATHER, TIME]})
    one = read_calls(' {"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}\n', tools)
    assert [c["function"] for c in one] == [{"name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}]
    assert one[0]["type"] == "function" and one[0]["id"].startswith("call_")
    many = read_calls('[{"name": "get_time", "parameters": {"zone": "UTC"}}, {"name": "get_time", "arguments": {}}]',
                      tools)  # Llama 3.1's "parameters"
    assert [json.loads(c["function"]["arguments"]) for c in many] == [{"zone": "UTC"}, {}]
    assert len({c["id"] for c in many}) == 2
    hermes = read_calls('<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>\n'
                        '<tool_call>{"name": "get_weather", "arguments": {}}</tool_call>', tools)
    assert [c["function"]["name"] for c in hermes] == ["get_time", "get_weather"]
    for text in ("It is sunny.", '{"name": "get_tide", "arguments": {}}', '{"name": "get_time"', '{"a": 1}',
                 '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and more', "[" * 100000,
                 '{"name": "get_time", "arguments": "zone=UTC"}', ""):
        assert read_calls(text, tools) is None, text


def test_streamed_text_is_held_only_while_it_may_be_a_call():
    auto = parse_tools({"tools": [WEATHER]})
    h = Held(auto)
    assert h.feed("  ", ("a",)) == ("", ()) and h.feed("It", ("b",)) == ("  It", ("a", "b"))  # released at once
    assert h.feed(" rains", ("c",)) == (" rains", ("c",)) and h.end() == ("", (), None)
    h = Held(auto)
    assert h.feed("<tool", (1,)) == ("", ()) and h.feed("th", (2,)) == ("<toolth", (1, 2))
    h = Held(auto)
    for piece in ('{"name": "get_weather", ', '"arguments": {"city": "Rome", "unit": "celsius"}}'):
        assert h.feed(piece, (0,)) == ("", ())
    text, logs, calls = h.end()
    assert logs == (0, 0) and calls[0]["function"]["name"] == "get_weather" and text.startswith("{")
    h = Held(auto)
    h.feed('{"not": "a call"}', ())
    assert h.end()[2] is None  # held to the end, then content after all
    free = Held(parse_tools({"tools": [WEATHER], "tool_choice": "none"}))
    assert free.feed("{", (1,)) == ("{", (1,)) and Held(None).feed("{", ()) == ("{", ())


def test_tool_turns_are_read_and_written_in_the_generic_format():
    sent = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Oslo and Rome?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                {"id": "c2", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "4 C"}, {"role": "tool", "tool_call_id": "c2",
                                                                        "content": "19 C"}]
    read = messages(sent, tools_ok=True)
    assert read[2]["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo"}  # an object, as templates read it
    out = generic_messages(read, (WEATHER,))
    assert [m["role"] for m in out] == ["system", "user", "assistant", "user"]  # results: one user turn
    assert out[0]["content"].startswith("You can call functions.") and out[0]["content"].endswith("Be brief.")
    assert '"name": "get_weather"' in out[0]["content"] and '"city"' in out[0]["content"]
    assert json.loads(out[2]["content"]) == [{"name": "get_weather", "arguments": {"city": "Oslo"}},
                                             {"name": "get_weather", "arguments": {"city": "Rome"}}]
    assert "The result of get_weather (call c1):\n4 C" in out[3]["content"] and "(call c2):\n19 C" in out[3]["content"]
    with pytest.raises(ApiError, match="no tool format: the server needs --chat-template") as e:
        messages(sent, tools_ok=False)
    assert e.value.param == "messages[2].role"
    bad = [*sent[:2], {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]}]
    with pytest.raises(ApiError, match="must be a JSON object") as e:
        messages(bad, tools_ok=True)
    assert e.value.param == "messages[2].tool_calls[0].function.arguments"
    with pytest.raises(ApiError) as e:
        messages([{"role": "tool", "content": "x"}], tools_ok=True)
    assert e.value.param == "messages[0].tool_call_id"


def test_a_model_without_a_tool_format_refuses_tools_naming_the_flag(default_tokenizer):
    """SmolLM2's own template has no tools: without --chat-template, `tools` is a 400 naming it (a real uvicorn
    server, no upstream reached); with the generic format the same body gets past the edge (to the absent upstream:
    a 5xx, not a 400)."""
    import http.client

    from spork_trt.serving.openai_api.app import create_app
    from spork_trt.serving.openai_api.model import ServedModel
    from tests.test_openai_edge import running

    body = json.dumps({"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
                       "tools": [WEATHER], "max_tokens": 8})
    for fmt in ("", "generic"):
        with running(create_app(ServedModel("m", default_tokenizer, 1024, 49152, fmt), "127.0.0.1:1", 1 << 16)) as port:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
            conn.request("POST", "/v1/chat/completions", body=body, headers={"Content-Type": "application/json"})
            r = conn.getresponse()
            got, err = r.status, json.loads(r.read())
            conn.close()
        if fmt:
            assert got >= 500, (got, err)  # past the edge: the upstream (none here) answers
        else:
            assert got == 400 and err["error"]["param"] == "tools", err
            assert "--chat-template generic" in err["error"]["message"]


HERMES = ("{% if tools %}<|im_start|>system\nTools:{% for t in tools %} {{ t.function.name }}{% endfor %}<|im_end|>\n"
          "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.tool_calls %}{% for c in m.tool_calls %}"
          "<tool_call>{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}</tool_call>"
          "{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_chat_template_file_that_reads_tools_writes_them_itself(tmp_path):
    """`serve --chat-template FILE` with a Hermes-style template (Qwen's way): the model's tool format is the
    template's, the tools and the assistant's earlier calls reach the prompt as it writes them, and its
    `<tool_call>` answers read back as calls; a file that fails on one message stops `serve`, not a request."""
    from spork_trt.checkpoint.tokenizer import load_tokenizer
    from spork_trt.checkpoint.weights import default_gguf_path
    from spork_trt.errors import UserError
    from spork_trt.serving.openai_api.model import ServedModel, tool_format

    tok = load_tokenizer(default_gguf_path(), "gguf")  # its own object: the template is replaced on it
    path = tmp_path / "hermes.jinja"
    path.write_text(HERMES)
    assert tool_format(tok, str(path)) == "template"
    model = ServedModel("m", tok, 1024, 49152, "template")
    tools = parse_tools({"tools": [WEATHER], "tool_choice": "auto"})
    sent = messages([{"role": "user", "content": "Oslo?"}, {"role": "assistant", "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "4 C"}], tools_ok=True)
    text = tok.hf.decode(model.chat_ids(sent, tools))
    assert text.startswith("<|im_start|>system\nTools: get_weather<|im_end|>") and text.endswith("assistant\n")
    assert '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>' in text, text
    assert read_calls('<tool_call>{"name": "get_weather", "arguments": {"city": "Bergen"}}</tool_call>', tools)
    path.write_text("{{ raise_exception('broken') }}")
    with pytest.raises(UserError, match="broken"):
        tool_format(load_tokenizer(default_gguf_path(), "gguf"), str(path))
    with pytest.raises(UserError, match="no such file"):
        tool_format(tok, str(tmp_path / "absent.jinja"))
    assert tool_format(load_tokenizer(default_gguf_path(), "gguf"), None) == ""  # SmolLM2's own: no tools
