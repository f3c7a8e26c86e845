"""Tool calling of a running `te serve` through the official `openai`
package.

full (a model whose template reads `tools`, Qwen2.5-Coder): a weather
function and a two-function case with `tool_choice` auto, required and
named; every call names a listed function and its arguments validate
against its schema (`jsonschema`); the streamed `delta.tool_calls`
assemble to the whole response's call; a tool result fed back (`role:
tool`) yields a final answer.

required (a model whose template has no tools, SmolLM2): `auto` answers
400 naming `tools`; `required` and a named function always yield a valid
call (constrained decoding), streamed equal to whole.

Run by tests/serve.rs (which starts the server).

usage: tools.py BASE_URL API_KEY MODEL full|required
"""

import json
import sys
import time

import jsonschema
import openai

BASE, KEY, MODEL, MODE = sys.argv[1:5]
client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, timeout=300, max_retries=0)
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 30},
        "unit": {"enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the current local time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 30}},
                   "required": ["timezone"]}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in [WEATHER, TIME]}
PARIS = [{"role": "user", "content": "What is the weather like in Paris today?"}]
TOKYO = [{"role": "user", "content": "What time is it in Tokyo?"}]


def valid_call(call, names, what):
    check(call.type == "function" and call.id and call.function.name in names, f"{what}: {call}")
    args = json.loads(call.function.arguments)
    try:
        jsonschema.validate(args, SCHEMAS[call.function.name])
    except jsonschema.ValidationError as e:
        raise AssertionError(f"{what}: arguments {args} invalid ({e.message})")
    return call.function.name, args


def ask(messages, tools, choice="auto", max_tokens=80):
    return client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice,
                                          max_tokens=max_tokens, temperature=0)


def streamed(messages, tools, choice="auto", max_tokens=80):
    """(content, {index: [id, name, arguments]}, finish) from the deltas."""
    content, calls, finish = "", {}, None
    for ch in client.chat.completions.create(model=MODEL, messages=messages, tools=tools, tool_choice=choice,
                                             max_tokens=max_tokens, temperature=0, stream=True):
        for c in ch.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                entry = calls.setdefault(d.index, ["", "", ""])
                entry[0] += d.id or ""
                if d.function:
                    entry[1] += d.function.name or ""
                    entry[2] += d.function.arguments or ""
            finish = c.finish_reason or finish
    return content, calls, finish


def one_call(r, names, what):
    c = r.choices[0]
    check(c.finish_reason == "tool_calls" and c.message.tool_calls and len(c.message.tool_calls) == 1,
          f"{what}: one call, finish tool_calls: {c}")
    return c.message.tool_calls[0], valid_call(c.message.tool_calls[0], names, what)


def same_streamed(r, messages, tools, choice, what):
    call = r.choices[0].message.tool_calls[0]
    content, calls, finish = streamed(messages, tools, choice)
    check(finish == "tool_calls" and list(calls) == [0], f"{what} streamed: {calls} {finish}")
    cid, name, args = calls[0]
    check(cid.startswith("call_") and name == call.function.name
          and json.loads(args) == json.loads(call.function.arguments), f"{what} streamed: {calls[0]} vs {call}")
    check(content == (r.choices[0].message.content or ""), f"{what} streamed content {content!r}")


def test_full():
    both = [WEATHER, TIME]
    call, (name, args) = one_call(ask(PARIS, [WEATHER]), ["get_weather"], "weather")
    check("paris" in args["city"].lower(), f"weather city: {args}")
    r = ask(TOKYO, both)
    _, (name, args) = one_call(r, ["get_time"], "two functions, time")
    check("tokyo" in args["timezone"].lower(), f"timezone: {args}")
    same_streamed(r, TOKYO, both, "auto", "two functions")
    r = ask(PARIS, both)
    call, (name, _) = one_call(r, ["get_weather"], "two functions, weather")
    # The tool's result fed back: a final answer that uses it.
    follow = PARIS + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    # (tool_choice none: the small models here would call again.)
    final = ask(follow, both, "none").choices[0]
    check(final.finish_reason == "stop" and not final.message.tool_calls and final.message.content,
          f"final answer: {final}")
    check("21" in final.message.content or "sunny" in final.message.content.lower(),
          f"the answer uses the result: {final.message.content!r}")
    # required and named: always a valid call, streamed equal to whole.
    chat = [{"role": "user", "content": "Tell me a joke."}]
    for choice, names in [("required", ["get_weather", "get_time"]),
                          ({"type": "function", "function": {"name": "get_time"}}, ["get_time"])]:
        r = ask(chat, both, choice)
        one_call(r, names, f"tool_choice {choice}")
        same_streamed(r, chat, both, choice, f"tool_choice {choice}")
    # none: an answer, no call.
    r = ask(PARIS, both, "none", max_tokens=12).choices[0]
    check(not r.message.tool_calls and r.finish_reason in ("stop", "length"), f"tool_choice none: {r}")


def test_required():
    chat = [{"role": "user", "content": "What is the weather like in Paris today?"}]
    try:
        ask(chat, [WEATHER, TIME])
        check(False, "auto on a template without tools must be refused")
    except openai.BadRequestError as e:
        check(e.body["param"] == "tools" and MODEL in e.body["message"], f"{e.body}")
    for choice, names in [("required", ["get_weather", "get_time"]),
                          ({"type": "function", "function": {"name": "get_weather"}}, ["get_weather"])]:
        for prompt in ["What is the weather like in Paris today?", "Write a poem about the sea."]:
            messages = [{"role": "user", "content": prompt}]
            r = ask(messages, [WEATHER, TIME], choice)
            one_call(r, names, f"{MODEL} tool_choice {choice} on {prompt!r}")
            same_streamed(r, messages, [WEATHER, TIME], choice, f"{MODEL} {choice}")


test = {"full": test_full, "required": test_required}[MODE]
start = time.time()
test()
print(f"ok {test.__name__} ({time.time() - start:.1f} s)")
print(f"all tool call checks passed ({checks} checks)")
