#!/usr/bin/env python3
"""Writes tests/refs/chat_templates/<template>.json: conversations rendered
by Hugging Face's own chat-template code.

    python3 tests/refs/make_chat_template_refs.py

Needs `transformers` (no PyTorch) and `jinja2` >= 3.1.6 in the Python that
runs it. Each template of tests/refs/chat_templates/src/ is rendered with
`transformers.utils.chat_template_utils.render_jinja_template` (what
`tokenizer.apply_chat_template(..., tokenize=False)` calls: jinja2
ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, Hugging Face's
`tojson`) for the cases below; each JSON file holds the template text, and
per case the inputs and the expected text.

Templates: qwen2.5-coder-1.5b (GGUF tokenizer.chat_template of
qwen2.5-coder-1.5b-instruct-q4_k_m.gguf), qwen2.5-instruct (that of
qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf, identical to Qwen2.5-7B-
Instruct's), llama-3.1-instruct (Llama-3.1-8B-Instruct's, as llama.cpp
keeps it in models/templates).
"""

import json
from pathlib import Path

import jinja2
import transformers
from transformers.utils.chat_template_utils import render_jinja_template

HERE = Path(__file__).resolve().parent / "chat_templates"

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city. Returns \"temp\" & <units>.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name, e.g. Zürich or 東京"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two numbers.\nBoth may be large.",
        "parameters": {
            "type": "object",
            "properties": {
                "b": {"type": "integer", "minimum": -3, "maximum": 1e20},
                "a": {"type": "number", "default": 1.5, "multipleOf": 1e-07, "exclusiveMinimum": 0.0001},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD]


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


USER_W = {"role": "user", "content": "What's the weather in Paris?"}
CALL_W = {"role": "assistant", "tool_calls": [call("get_weather", {"city": "Paris", "unit": "celsius"})]}
RESULT_W = {"role": "tool", "content": "{\"temp\": 21.5, \"sky\": \"clear\"}", "tool_call_id": "call_1", "name": "get_weather"}

COMMON = [
    ("plain", [{"role": "user", "content": "Hello!"}], None, True),
    ("system_user", [{"role": "system", "content": "  You are a pirate.  "}, {"role": "user", "content": "Hi"}], None, True),
    ("no_generation_prompt", [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}], None, False),
    ("multi_turn", [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Quote \" backslash \\ tab\t and <html> & ünïcode 🦀"},
        {"role": "assistant", "content": "Noted.\n\nLine two."},
        {"role": "user", "content": "Thanks"},
    ], None, True),
    ("tools", [USER_W], TOOLS, True),
    ("tools_with_system", [{"role": "system", "content": "You are a weather bot."}, USER_W], TOOLS, True),
    ("tool_call_dict_args", [USER_W, CALL_W, RESULT_W], TOOLS, True),
    ("tool_call_string_args", [
        USER_W,
        {"role": "assistant", "tool_calls": [call("get_weather", "{\"city\": \"Paris\"}")]},
        RESULT_W,
    ], TOOLS, True),
    ("tool_call_numbers", [
        {"role": "user", "content": "Add them."},
        {"role": "assistant", "tool_calls": [call("add", {
            "b": 9007199254740993, "a": 2.5,
            "flags": [True, False, None],
            "nested": {"z": 1, "a": [1.0, 1e-07, 1e16, -0.5, 123456789.125]},
            "text": "ü \"q\" \\ \n",
        })]},
        {"role": "tool", "content": "9007199254740995.5", "tool_call_id": "call_2", "name": "add"},
    ], TOOLS, True),
]
QWEN_ONLY = [
    ("parallel_tool_calls", [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Paris and Oslo, and 1+2?"},
        {"role": "assistant", "content": "Let me check.", "tool_calls": [
            call("get_weather", {"city": "Paris"}),
            call("get_weather", {"city": "Oslo"}),
            call("add", {"a": 1, "b": 2}),
        ]},
        {"role": "tool", "content": "sunny", "tool_call_id": "a", "name": "get_weather"},
        {"role": "tool", "content": "rain", "tool_call_id": "b", "name": "get_weather"},
        {"role": "tool", "content": "3", "tool_call_id": "c", "name": "add"},
        {"role": "assistant", "content": "Paris is sunny, Oslo rainy; 1+2=3."},
        {"role": "user", "content": "Thanks!"},
    ], TOOLS, True),
    ("tool_first_message", [
        {"role": "tool", "content": "orphan result"},
        {"role": "user", "content": "ok"},
    ], None, True),
]

TEMPLATES = {
    "qwen2.5-coder-1.5b": (COMMON + QWEN_ONLY, "", "<|im_end|>"),
    "qwen2.5-instruct": (COMMON + QWEN_ONLY, "", "<|im_end|>"),
    "llama-3.1-instruct": (COMMON, "<|begin_of_text|>", "<|eot_id|>"),
}


def main():
    for name, (cases, bos, eos) in TEMPLATES.items():
        template = (HERE / "src" / f"{name}.jinja").read_text()
        out_cases = []
        for case, messages, tools, add_generation_prompt in cases:
            rendered, _ = render_jinja_template(
                conversations=[messages],
                tools=tools,
                chat_template=template,
                add_generation_prompt=add_generation_prompt,
                bos_token=bos,
                eos_token=eos,
            )
            out_cases.append({
                "name": case,
                "messages": messages,
                "tools": tools,
                "add_generation_prompt": add_generation_prompt,
                "bos_token": bos,
                "eos_token": eos,
                "expected": rendered[0],
            })
        doc = {
            "template_name": name,
            "rendered_by": f"transformers {transformers.__version__} render_jinja_template, jinja2 {jinja2.__version__}",
            "template": template,
            "cases": out_cases,
        }
        path = HERE / f"{name}.json"
        path.write_text(json.dumps(doc, ensure_ascii=False, indent=1) + "\n")
        print(f"{path}: {len(out_cases)} cases")


if __name__ == "__main__":
    main()
