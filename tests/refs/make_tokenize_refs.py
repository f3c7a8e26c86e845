#!/usr/bin/env python3
"""Writes tests/refs/<model>/tokenize.jsonl for the Qwen2.5-Coder GGUF files
with llama.cpp's `llama-tokenize`.

    python3 tests/refs/make_tokenize_refs.py LLAMA_TOKENIZE [MODEL ...]
    python3 tests/refs/make_tokenize_refs.py LLAMA_TOKENIZE --pre-variants

LLAMA_TOKENIZE: the `llama-tokenize` binary. MODEL: folder names below
(default: all). The GGUF files are read from $TE_HOME (default
~/.cache/te), as `cargo xtask fetch-models` leaves them.

Each text is written to a file and tokenized with `-f FILE --no-escape
--ids --log-disable` (the bytes exactly as written), once as is (`ids`:
special-token text parsed, BOS as the file's add_bos_token says) and once
with `--no-parse-special` (`ids_no_parse_special`). The texts are those of
tests/refs/smollm2-135m/tokenize.jsonl plus the cases below.

`--pre-variants`: the same texts through other pre-tokenizers, for want of
GGUF files that have them: a copy of qwen2.5-coder-0.5b's metadata (no
tensors; llama-tokenize loads the vocabulary only) with
`tokenizer.ggml.pre` set to each of PRE_VARIANTS (and, for `llama-bpe`,
`add_bos_token` removed, so llama.cpp's default for that name applies:
BOS added), written to qwen2.5-coder-0.5b/tokenize_pre_<pre>.jsonl.
crates/te-tokenizer/tests/tokenize_refs.rs makes the same copy.
"""

import json
import os
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

REFS = Path(__file__).resolve().parent
MODELS = {
    "qwen2.5-coder-0.5b": "qwen2.5-coder-0.5b-instruct-awq-q4_k_m.gguf",
    "qwen2.5-coder-1.5b": "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
}
EXTRA = [
    ("cjk", "東京は日本の首都です。北京欢迎你！서울 특별시에 갑니다."),
    ("emoji", "I ❤️ Rust 🦀🎉 family 👨‍👩‍👧‍👦 flag 🇫🇷 thumbs 👍🏽 end"),
    ("code_tabs", "def f(x):\n\tif x:\n\t    return x  # mixed\n    \telse:\n\t\treturn None\n\n\n"),
    ("numbers", "1234567 12.5% 0x1F 3.14159e-10 1,234,567 v2.0.1 ٣٤٥ ½ 100000000000"),
    ("contractions", "I'm sure you'LL see it's THEY'RE we've I'D don't"),
    ("chatml", "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"),
    ("tool_call", "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>"),
    ("fim", "<|fim_prefix|>def add(a, b):\n<|fim_suffix|>\n    return c<|fim_middle|>"),
    ("endoftext", "end of doc<|endoftext|>next doc <|im_end|>"),
    ("trailing_ws", "trailing spaces   \n\n\n   \n\t \nend  \n\n"),
    ("crlf", "line one\r\nline two\r\n\r\n  indented\r\n"),
    ("long_spaces", "x" + " " * 20 + "y" + "\t" * 5 + "z" + "\n" * 7),
    ("unicode_ws", "a\u00a0b\u3000c\u2003d \u200b e"),
    ("combining", "e\u0301te\u0301 cafe\u0301 Zürich ÅNGSTRÖM"),
    ("control_looking", "a</s>b </s> <|fim_pad|><|repo_name|>x<|file_sep|>"),
    ("punct", "Hello!!! What?!... (a) [b] {c} <d> \"e\" 'f' --g-- __h__ @i #j $k"),
]


PRE_VARIANTS = ["llama-bpe", "default", "gpt-2", "smollm"]
EXTRA_PRE = [
    ("digits_long", "x 1234567890123 y 12 345 6789 ٣٤٥٦٧"),
    ("contractions_2", "you'RE 'll 'LL 'Ll ' s'd"),
]


def metadata_copy(src, dst, pre, drop):
    """`src`'s metadata without tensors, `tokenizer.ggml.pre` = `pre`, the
    keys of `drop` left out (GGUF v2/v3 layout)."""
    data = Path(src).read_bytes()
    assert data[:4] == b"GGUF"
    version, = struct.unpack_from("<I", data, 4)
    _, n_kv = struct.unpack_from("<QQ", data, 8)
    sizes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}

    def skip(kind, pos):
        if kind == 8:
            n, = struct.unpack_from("<Q", data, pos)
            return pos + 8 + n
        if kind == 9:
            item, n = struct.unpack_from("<IQ", data, pos)
            pos += 12
            if item in sizes:
                return pos + sizes[item] * n
            for _ in range(n):
                pos = skip(item, pos)
            return pos
        return pos + sizes[kind]

    def string(s):
        b = s.encode()
        return struct.pack("<Q", len(b)) + b

    kept, pos = [], 24
    for _ in range(n_kv):
        start = pos
        n, = struct.unpack_from("<Q", data, pos)
        key = data[pos + 8:pos + 8 + n].decode()
        kind, = struct.unpack_from("<I", data, pos + 8 + n)
        pos = skip(kind, pos + 12 + n)
        if key != "tokenizer.ggml.pre" and key not in drop:
            kept.append(data[start:pos])
    kept.append(string("tokenizer.ggml.pre") + struct.pack("<I", 8) + string(pre))
    blob = b"GGUF" + struct.pack("<IQQ", version, 0, len(kept)) + b"".join(kept)
    Path(dst).write_bytes(blob + b"\0" * (-len(blob) % 32))


def tokenize(binary, gguf, text, parse_special):
    with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        f.write(text.encode("utf-8"))
        path = f.name
    try:
        cmd = [binary, "-m", str(gguf), "-f", path, "--no-escape", "--ids", "--log-disable"]
        if not parse_special:
            cmd.append("--no-parse-special")
        out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(path)
    lines = [l for l in out.splitlines() if l.startswith("[")]
    if len(lines) != 1:
        sys.exit(f"unexpected llama-tokenize output for {text!r}:\n{out}")
    return json.loads(lines[0])


def main():
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    binary = sys.argv[1]
    home = Path(os.environ.get("TE_HOME", Path.home() / ".cache" / "te"))
    base = [json.loads(l) for l in (REFS / "smollm2-135m" / "tokenize.jsonl").read_text().splitlines() if l.strip()]
    cases = [(c["name"], c["text"]) for c in base] + EXTRA
    if sys.argv[2:] == ["--pre-variants"]:
        with tempfile.TemporaryDirectory() as tmp:
            for pre in PRE_VARIANTS:
                gguf = Path(tmp) / f"{pre}.gguf"
                drop = {"tokenizer.ggml.add_bos_token"} if pre == "llama-bpe" else set()
                metadata_copy(home / MODELS["qwen2.5-coder-0.5b"], gguf, pre, drop)
                write(binary, gguf, cases + EXTRA_PRE, REFS / "qwen2.5-coder-0.5b" / f"tokenize_pre_{pre}.jsonl")
        return
    for name in sys.argv[2:] or list(MODELS):
        write(binary, home / MODELS[name], cases, REFS / name / "tokenize.jsonl")


def write(binary, gguf, cases, out):
    rows = []
    for case, text in cases:
        rows.append({
            "name": case,
            "text": text,
            "ids": tokenize(binary, gguf, text, True),
            "ids_no_parse_special": tokenize(binary, gguf, text, False),
        })
    out.parent.mkdir(exist_ok=True)
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    print(f"{out}: {len(rows)} texts")


if __name__ == "__main__":
    main()
