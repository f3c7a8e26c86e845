"""Structured outputs of a running `te serve` through the official `openai`
package: JSON schemas (nested objects, arrays, enums, required fields,
bounded numbers, patterns, anyOf, null) answered whole and streamed, every
output parsed and validated with `jsonschema`; an unconstrained request
batched with the constrained ones keeps its exact tokens; bad and
oversized schemas answer 400 naming the schema; the server stays healthy.

Run by tests/serve.rs (which starts the server).

usage: structured.py BASE_URL API_KEY MODEL
"""

import asyncio
import json
import sys
import time

import jsonschema
import openai

BASE, KEY, MODEL = sys.argv[1:4]
client = openai.OpenAI(base_url=BASE + "/v1", api_key=KEY, timeout=120, max_retries=0)
checks = 0


def check(cond, what):
    global checks
    if not cond:
        raise AssertionError(what)
    checks += 1


def obj(props, required=None):
    return {"type": "object", "properties": props, "required": required or list(props),
            "additionalProperties": False}


NAME = {"type": "string", "maxLength": 12}
# (prompt, schema): strings, arrays and numbers are bounded so that every
# answer ends within the token budget.
CASES = [
    ("Describe a person as JSON.", obj({"name": NAME, "age": {"type": "integer", "minimum": 0, "maximum": 120}})),
    ("Pick a color.", obj({"color": {"enum": ["red", "green", "blue"]}})),
    ("List a few small numbers.", {"type": "array", "items": {"type": "integer", "minimum": 1, "maximum": 9},
                                   "minItems": 2, "maxItems": 4}),
    ("Describe a city.", obj({"city": obj({"name": NAME, "population": {"type": "integer", "minimum": 0,
                                                                        "maximum": 99999999}})})),
    ("Give a US zip code.", obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}})),
    ("Rate this answer.", obj({"ok": {"type": "boolean"}, "score": {"type": "integer", "minimum": 1, "maximum": 5}})),
    ("Make two tagged items.", {"type": "array", "maxItems": 2, "items": obj({
        "id": {"type": "integer", "minimum": 0, "maximum": 99}, "tag": {"enum": ["x", "y"]}})}),
    ("Yes or no?", {"enum": ["yes", "no"]}),
    ("A point on a grid.", obj({"kind": {"const": "point"}, "x": {"type": "integer", "minimum": -9, "maximum": 9},
                                "y": {"type": "integer", "minimum": -9, "maximum": 9}})),
    ("A digit or a short word.", {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9},
                                            {"type": "string", "maxLength": 5}]}),
    ("An email address.", {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}),
    ("A note, or nothing.", obj({"note": {"anyOf": [{"type": "string", "maxLength": 10}, {"type": "null"}]}})),
    ("A book.", obj({"title": NAME, "year": {"type": "integer", "minimum": 1500, "maximum": 2025},
                     "genres": {"type": "array", "items": {"enum": ["fiction", "poetry", "history"]},
                                "maxItems": 2}}, ["title", "year"])),
]


def fmt(schema):
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


async def constrained(c, prompt, schema, stream):
    kw = dict(model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=80, temperature=0,
              response_format=fmt(schema))
    if not stream:
        r = await c.chat.completions.create(**kw)
        return r.choices[0].message.content, r.choices[0].finish_reason
    text, finish = "", None
    async for ch in await c.chat.completions.create(**kw, stream=True):
        for choice in ch.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


async def plain(c):
    r = await c.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=24, temperature=0,
                                   extra_body={"return_token_ids": True, "ignore_eos": True})
    return r.choices[0].token_ids


async def batch():
    """The unconstrained request alone, then among every constrained one."""
    c = openai.AsyncOpenAI(base_url=BASE + "/v1", api_key=KEY, timeout=300, max_retries=0)
    alone = await plain(c)
    jobs = [constrained(c, p, s, stream) for p, s in CASES for stream in (False, True)]
    out = await asyncio.gather(plain(c), *jobs)
    await c.close()
    return alone, out[0], out[1:]


def test_schemas_batched():
    alone, batched, results = asyncio.run(batch())
    check(len(alone) == 24 and batched == alone,
          f"the unconstrained request in the batch keeps its tokens: {alone} vs {batched}")
    for i, (text, finish) in enumerate(results):
        prompt, schema = CASES[i // 2]
        what = f"{prompt!r} ({'streamed' if i % 2 else 'whole'}): {text!r}"
        check(finish == "stop", f"{what}: finish_reason {finish}")
        try:
            value = json.loads(text)
        except ValueError as e:
            raise AssertionError(f"{what}: not JSON ({e})")
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as e:
            raise AssertionError(f"{what}: invalid ({e.message})")
        check(True, what)


def test_json_object():
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Give me a person with a name and an age as JSON."}],
                                       max_tokens=80, temperature=0, response_format={"type": "json_object"})
    c = r.choices[0]
    check(c.finish_reason == "stop" and isinstance(json.loads(c.message.content), dict),
          f"json_object: {c.message.content!r}")


def error_param(kw):
    try:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=4, **kw)
    except openai.BadRequestError as e:
        return e.body.get("param"), e.body.get("message")
    raise AssertionError(f"{kw} must be refused")


def test_bad_schemas():
    schema_param = "response_format.json_schema.schema"
    deep = {"type": "string"}
    for _ in range(30):
        deep = {"type": "array", "items": deep}
    big = obj({f"field_{i}": {"type": "string"} for i in range(3000)})
    for schema, word in [({"type": "frob"}, "frob"), ({"$ref": "#/nowhere"}, "nowhere"),
                         ({"type": "integer", "minimum": 5, "maximum": 1}, ""), (deep, "deep"), (big, "bytes")]:
        param, message = error_param({"response_format": fmt(schema)})
        check(param == schema_param and word in message, f"{schema!s:.80}: {param} {message}")
    param, _ = error_param({"response_format": {"type": "xml"}})
    check(param == "response_format.type", f"type xml: {param}")
    # Pathological patterns answer (a 400 or a bounded answer), never hang.
    for pattern in ["^(a{1,200}){1,200}(b{1,200}){1,200}$", "^((a|aa)*)*b$", "^(.*a){30}$"]:
        start = time.time()
        try:
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=8, temperature=0,
                response_format=fmt({"type": "string", "pattern": pattern}))
            check(r.choices[0].finish_reason in ("stop", "length"), f"pattern {pattern}")
        except openai.BadRequestError as e:
            check(e.body["param"] == schema_param, f"pattern {pattern}: {e.body}")
        check(time.time() - start < 60, f"pattern {pattern} took {time.time() - start:.0f} s")
    models = client.models.list()
    check(models.data[0].id == MODEL, "still serving")


for test in [test_schemas_batched, test_json_object, test_bad_schemas]:
    start = time.time()
    test()
    print(f"ok {test.__name__} ({time.time() - start:.1f} s)", flush=True)
print(f"all structured output checks passed ({checks} checks)")
