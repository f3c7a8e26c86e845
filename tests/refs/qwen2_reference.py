#!/usr/bin/env python3
"""Float64 reference forward pass of Qwen2 (and Llama) GGUF models.

Independent of te-rs: it reads the GGUF with the `gguf` package, dequantizes
every tensor with `gguf.quants.dequantize` (the values are exact float32
numbers, kept as float32 and cast to float64 where used) and computes the
whole forward in float64 with numpy. It writes the reference files of
`tests/refs/<model>/` (see tests/refs/README.md).

Made with Python 3.11, numpy 2.4.6, gguf 0.19.0, Jinja2 3.1.6:

    python3 -m venv /work/venv-refs
    /work/venv-refs/bin/pip install numpy==2.4.6 gguf==0.19.0 jinja2==3.1.6

Commands:

    info MODEL.gguf
        the model's facts (config, tensor types, tokenizer metadata).
    check-llama MODEL.gguf REFDIR
        runs the prompts of REFDIR/greedy.jsonl and REFDIR/top20_*.json
        (an existing llama reference, e.g. tests/refs/smollm2-135m) and
        prints the largest differences: validates this script.
    refs MODEL.gguf OUTDIR --llama-tokenize PATH [--skip-ppl] [--only-ppl]
        writes OUTDIR/greedy.jsonl, top20_capital.json, top20_code.json and
        perplexity.json (GPL-3, ctx 512).

Model math (Qwen2, the `qwen2` GGUF architecture): token embedding lookup;
per layer x = RMSNorm(h) * attn_norm; q, k, v = x W^T + b (biases on q, k,
v only); RoPE on whole heads, half-split pairs (i, i + d/2) for qwen2
(interleaved pairs (2i, 2i+1) for llama, whose GGUF Q/K rows are permuted
for it), angle = pos * base^(-2i/d); causal softmax(q k^T / sqrt(d)) v with
grouped KV heads; h += o W_o^T; h += W_down (silu(W_gate n) * W_up n) with
n = RMSNorm(h) * ffn_norm; logits = RMSNorm(h) * output_norm W_out^T, W_out
= output.weight, or token_embd.weight when the file has no output.weight.
"""

import argparse
import hashlib
import json
import math
import subprocess
import sys
import time

import numpy as np
import gguf
from gguf import GGUFReader

F64 = np.float64


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def matmul_t(x, w):
    """x @ w^T in float64 for float64 `x` [T, in] and float32 `w` [out, in].
    Few rows (decoding): `w` is cast in blocks of rows that stay in cache
    rather than as a whole float64 copy (the cast, not the product, is
    then the cost)."""
    if x.shape[0] >= 64:
        return x @ w.astype(F64).T
    out = np.empty((x.shape[0], w.shape[0]), dtype=F64)
    step = max(1, (1 << 21) // (w.shape[1] * 8))
    for r in range(0, w.shape[0], step):
        out[:, r : r + step] = x @ w[r : r + step].astype(F64).T
    return out


class Model:
    def __init__(self, path):
        t0 = time.time()
        r = GGUFReader(path)
        self.reader = r
        arch = field(r, "general.architecture")
        if arch not in ("qwen2", "llama"):
            raise SystemExit(f"unsupported architecture {arch}")
        self.arch = arch
        self.n_layer = int(field(r, f"{arch}.block_count"))
        self.hidden = int(field(r, f"{arch}.embedding_length"))
        self.n_head = int(field(r, f"{arch}.attention.head_count"))
        self.n_kv = int(field(r, f"{arch}.attention.head_count_kv"))
        self.head_dim = self.hidden // self.n_head
        self.eps = float(field(r, f"{arch}.attention.layer_norm_rms_epsilon"))
        self.rope_base = float(field(r, f"{arch}.rope.freq_base"))
        self.interleaved = arch == "llama"
        self.types = {}
        self.w = {}
        for t in r.tensors:
            self.types[t.name] = t.tensor_type.name
            shape = tuple(int(x) for x in reversed(t.shape))
            a = gguf.quants.dequantize(t.data, t.tensor_type)
            a = np.asarray(a, dtype=np.float32).reshape(shape)
            self.w[t.name] = a
        self.tied = "output.weight" not in self.w
        self.out_name = "token_embd.weight" if self.tied else "output.weight"
        self.vocab = self.w["token_embd.weight"].shape[0]
        d = self.head_dim
        self.inv_freq = self.rope_base ** (-np.arange(0, d // 2, dtype=F64) * 2.0 / d)
        print(f"loaded {path} in {time.time() - t0:.1f}s", file=sys.stderr)

    def lin(self, x, name):
        y = matmul_t(x, self.w[name + ".weight"])
        b = self.w.get(name + ".bias")
        if b is not None:
            y = y + b.astype(F64)
        return y

    def norm(self, x, name):
        ms = np.mean(x * x, axis=-1, keepdims=True)
        return x / np.sqrt(ms + self.eps) * self.w[name].astype(F64)

    def rope(self, x, pos):
        # x: [T, heads, d]; pos: [T]
        d = self.head_dim
        ang = pos.astype(F64)[:, None] * self.inv_freq[None, :]  # [T, d/2]
        cos = np.cos(ang)[:, None, :]
        sin = np.sin(ang)[:, None, :]
        if self.interleaved:
            a, b = x[..., 0::2], x[..., 1::2]
        else:
            a, b = x[..., : d // 2], x[..., d // 2 :]
        ra = a * cos - b * sin
        rb = b * cos + a * sin
        out = np.empty_like(x)
        if self.interleaved:
            out[..., 0::2], out[..., 1::2] = ra, rb
        else:
            out[..., : d // 2], out[..., d // 2 :] = ra, rb
        return out

    def new_cache(self):
        return [[None, None] for _ in range(self.n_layer)]

    def forward(self, ids, cache, start, logits_from=0):
        """Feeds `ids` at positions start.. after the cached ones; returns the
        float64 logits of the new positions from index `logits_from` on."""
        return self.forward_multi([(ids, cache, start, logits_from)])[0]

    def forward_multi(self, segments):
        """Several independent sequences in one pass (the linear layers run
        on all their rows at once, attention per sequence): `segments` =
        [(ids, cache, start, logits_from)]; returns each one's logits."""
        d, H, KV = self.head_dim, self.n_head, self.n_kv
        group = H // KV
        lens = [len(s[0]) for s in segments]
        offs = np.cumsum([0] + lens)
        T = int(offs[-1])
        ids = np.concatenate([np.asarray(s[0], dtype=np.int64) for s in segments])
        pos = np.concatenate([np.arange(s[2], s[2] + n) for s, n in zip(segments, lens)])
        h = self.w["token_embd.weight"][ids].astype(F64)
        scale = 1.0 / math.sqrt(d)
        for layer in range(self.n_layer):
            p = f"blk.{layer}."
            x = self.norm(h, p + "attn_norm.weight")
            q = self.rope(self.lin(x, p + "attn_q").reshape(T, H, d), pos)
            k_all = self.rope(self.lin(x, p + "attn_k").reshape(T, KV, d), pos)
            v_all = self.lin(x, p + "attn_v").reshape(T, KV, d)
            att = np.empty((T, H, d), dtype=F64)
            for si, (_, cache, start, _) in enumerate(segments):
                a, b = offs[si], offs[si + 1]
                k, v = k_all[a:b], v_all[a:b]
                c = cache[layer]
                if c[0] is not None:
                    k = np.concatenate([c[0], k], axis=0)
                    v = np.concatenate([c[1], v], axis=0)
                c[0], c[1] = k, v
                S, n = k.shape[0], b - a
                # query t (position start + t) sees keys 0 ..= start + t
                mask = np.arange(S)[None, :] > (start + np.arange(n))[:, None]
                for kh in range(KV):
                    kk = k[:, kh, :]  # [S, d]
                    vv = v[:, kh, :]
                    for g in range(group):
                        qh = kh * group + g
                        sc = (q[a:b, qh, :] @ kk.T) * scale  # [n, S]
                        sc[mask] = -np.inf
                        sc = sc - sc.max(axis=1, keepdims=True)
                        e = np.exp(sc)
                        e /= e.sum(axis=1, keepdims=True)
                        att[a:b, qh, :] = e @ vv
            h = h + self.lin(att.reshape(T, H * d), p + "attn_output")
            n = self.norm(h, p + "ffn_norm.weight")
            gate = self.lin(n, p + "ffn_gate")
            up = self.lin(n, p + "ffn_up")
            act = gate / (1.0 + np.exp(-gate)) * up
            h = h + self.lin(act, p + "ffn_down")
        rows = np.concatenate(
            [np.arange(offs[i] + s[3], offs[i + 1]) for i, s in enumerate(segments)]
        )
        out = matmul_t(self.norm(h[rows], "output_norm.weight"), self.w[self.out_name])
        res, at = [], 0
        for n, s in zip(lens, segments):
            m = n - s[3]
            res.append(out[at : at + m])
            at += m
        return res


def greedy_many(model, prompt_ids, n_new, top20):
    """Greedy decoding of several prompts (EOS not special), each prefilled
    alone, then decoded together one token per prompt per step. Returns per
    prompt (tokens, top-20 rows or [], top-2 margins): with `top20[i]`, the
    20 largest logits at every position of prompt + continuation except the
    last."""
    k = len(prompt_ids)
    caches = [model.new_cache() for _ in range(k)]
    rows = [[] for _ in range(k)]
    margins = [[] for _ in range(k)]
    outs = [[] for _ in range(k)]

    def record(i, row_logits, pos):
        if top20[i]:
            idx = np.argsort(-row_logits, kind="stable")[:20]
            rows[i].append(
                {
                    "pos": pos,
                    "ids": [int(j) for j in idx],
                    "logits": [round(float(row_logits[j]), 6) for j in idx],
                }
            )

    last = []
    for i, ids in enumerate(prompt_ids):
        t0 = time.time()
        logits = model.forward(ids, caches[i], 0, 0 if top20[i] else len(ids) - 1)
        if top20[i]:
            for p in range(len(ids) - 1):
                record(i, logits[p], p)
        last.append(logits[-1])
        print(f"prefill {i}: {len(ids)} tokens ({time.time() - t0:.0f}s)", file=sys.stderr, flush=True)
    for step in range(n_new):
        t0 = time.time()
        for i in range(k):
            record(i, last[i], len(prompt_ids[i]) + step - 1)
            top2 = np.partition(-last[i], 1)[:2]
            margins[i].append(float(top2[1] - top2[0]))
            outs[i].append(int(np.argmax(last[i])))
        if step + 1 < n_new:
            segs = [
                ([outs[i][-1]], caches[i], len(prompt_ids[i]) + step, 0) for i in range(k)
            ]
            last = [r[-1] for r in model.forward_multi(segs)]
        print(f"decode step {step + 1}/{n_new} ({time.time() - t0:.1f}s)", file=sys.stderr, flush=True)
    return [(outs[i], rows[i], margins[i]) for i in range(k)]


def greedy(model, prompt_ids, n_new, top20=False):
    """One prompt's greedy tokens, top-20 rows and margins (greedy_many)."""
    return greedy_many(model, [prompt_ids], n_new, [top20])[0]


def log_softmax_at(logits, targets):
    m = logits.max(axis=1, keepdims=True)
    lse = np.log(np.exp(logits - m).sum(axis=1)) + m[:, 0]
    return logits[np.arange(len(targets)), targets] - lse


def perplexity(model, tokens, ctx, bos=None):
    """llama-perplexity's default mode, as te's perplexity.rs documents it."""
    n_chunks = len(tokens) // ctx
    first = ctx // 2
    nll_sum = 0.0
    count = 0
    running = []
    for c in range(n_chunks):
        t0 = time.time()
        win = list(tokens[c * ctx : (c + 1) * ctx])
        if bos is not None:
            win[0] = bos
        logits = model.forward(win, model.new_cache(), 0, logits_from=first)
        # logits rows j = first .. ctx-1; rows first .. ctx-2 predict j + 1
        targets = np.asarray(win[first + 1 : ctx])
        lp = log_softmax_at(logits[: ctx - 1 - first], targets)
        nll_sum += float(-lp.sum())
        count += len(targets)
        running.append(math.exp(nll_sum / count))
        print(
            f"ppl window {c + 1}/{n_chunks}: running {running[-1]:.6f} ({time.time() - t0:.0f}s)",
            file=sys.stderr,
            flush=True,
        )
    return {
        "ppl": math.exp(nll_sum / count),
        "nll_mean": nll_sum / count,
        "windows": n_chunks,
        "scored_tokens": count,
        "running_ppl": running,
    }


def llama_tokenize(tool, model_path, text):
    out = subprocess.run(
        [tool, "-m", model_path, "-p", text, "--ids", "--log-disable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    line = [l for l in out.splitlines() if l.startswith("[")][-1]
    return json.loads(line)


def llama_tokenize_file(tool, model_path, path):
    out = subprocess.run(
        [tool, "-m", model_path, "-f", path, "--ids", "--log-disable"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    line = [l for l in out.splitlines() if l.startswith("[")][-1]
    return json.loads(line)


def render_chat(template, messages):
    """Renders a chat template as Hugging Face's apply_chat_template does."""
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.globals["raise_exception"] = raise_exception
    return env.from_string(template).render(messages=messages, add_generation_prompt=True)


GPL3 = "/usr/share/common-licenses/GPL-3"

CODE_PROMPT = (
    "def fibonacci(n):\n"
    '\t"""Return the n-th Fibonacci number."""\n'
    "\tif n < 2:\n"
    "\t\treturn n\n"
)
CHAT_MESSAGES = [
    {
        "role": "user",
        "content": "Write a Python function that checks whether a string is a palindrome.",
    }
]


def prompts(template):
    with open(GPL3, encoding="utf-8") as f:
        gpl = f.read()
    # the first ~4,800 characters, cut at a line end (1,020 Qwen tokens)
    long_text = gpl[: gpl.rindex("\n", 0, 4800) + 1]
    out = [
        {"name": "very_short", "prompt": "Hello"},
        {"name": "capital", "prompt": "The capital of France is"},
        {"name": "code", "prompt": CODE_PROMPT},
        {"name": "long", "prompt": long_text},
        {"name": "cjk", "prompt": "请用一句话介绍北京的历史。北京是"},
    ]
    if template:
        out.append(
            {
                "name": "chat",
                "prompt": render_chat(template, CHAT_MESSAGES),
                "chat_messages": CHAT_MESSAGES,
            }
        )
    return out


def cmd_info(args):
    r = GGUFReader(args.model)
    arch = field(r, "general.architecture")
    keys = [
        "general.name",
        "general.architecture",
        "general.file_type",
        f"{arch}.block_count",
        f"{arch}.context_length",
        f"{arch}.embedding_length",
        f"{arch}.feed_forward_length",
        f"{arch}.attention.head_count",
        f"{arch}.attention.head_count_kv",
        f"{arch}.rope.freq_base",
        f"{arch}.rope.dimension_count",
        f"{arch}.attention.layer_norm_rms_epsilon",
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.add_bos_token",
        "tokenizer.ggml.add_eos_token",
        "tokenizer.ggml.bos_token_id",
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.padding_token_id",
    ]
    for k in keys:
        print(f"{k} = {field(r, k)!r}")
    print("vocab =", len(r.fields["tokenizer.ggml.tokens"].data))
    print("chat_template present =", "tokenizer.chat_template" in r.fields)
    types = {}
    for t in r.tensors:
        kind = t.name.split(".", 2)[-1] if t.name.startswith("blk.") else t.name
        types.setdefault(t.tensor_type.name, set()).add(kind)
    for ty, names in sorted(types.items()):
        print(f"{ty}: {sorted(names)}")
    print("tied =", not any(t.name == "output.weight" for t in r.tensors))


def cmd_check_llama(args):
    model = Model(args.model)
    worst_logit = 0.0
    mismatches = 0
    with open(f"{args.refdir}/greedy.jsonl", encoding="utf-8") as f:
        refs = [json.loads(line) for line in f]
    results = greedy_many(model, [r["prompt_tokens"] for r in refs], 32, [False] * len(refs))
    for ref, (toks, _, margins) in zip(refs, results):
        same = toks == ref["tokens"]
        mismatches += not same
        print(f"{ref['name']}: tokens {'match' if same else 'DIFFER'} (min margin {min(margins):.4f})")
    for name in args.top20:
        with open(f"{args.refdir}/top20_{name}.json", encoding="utf-8") as f:
            ref = json.load(f)
        ids = ref["token_ids"]
        logits = model.forward(ids, model.new_cache(), 0)
        for row in ref["rows"]:
            got = logits[row["pos"]]
            for i, want in zip(row["ids"], row["logits"]):
                worst_logit = max(worst_logit, abs(float(got[i]) - want))
        print(f"top20_{name}: worst |logit diff| so far {worst_logit:.3e}")
    print(f"greedy prompts differing: {mismatches}; worst top-20 logit diff {worst_logit:.3e}")


def cmd_refs(args):
    import os

    model_path = args.model
    os.makedirs(args.outdir, exist_ok=True)
    template = field(GGUFReader(model_path), "tokenizer.chat_template")
    if not args.only_ppl:
        model = Model(model_path)
        ps = prompts(template)
        all_ids = [llama_tokenize(args.llama_tokenize, model_path, p["prompt"]) for p in ps]
        want = [p["name"] in ("capital", "code") for p in ps]
        results = greedy_many(model, all_ids, 32, want)
        with open(f"{args.outdir}/greedy.jsonl", "w", encoding="utf-8") as f:
            for p, ids, (toks, rows, margins) in zip(ps, all_ids, results):
                rec = dict(p)
                rec["prompt_tokens"] = ids
                rec["tokens"] = toks
                rec["min_top2_margin"] = round(min(margins), 6)
                f.write(json.dumps(rec, ensure_ascii=False) + "\n")
                if rows:
                    with open(f"{args.outdir}/top20_{p['name']}.json", "w", encoding="utf-8") as g:
                        json.dump(
                            {
                                "prompt": p["prompt"],
                                "n_prompt": len(ids),
                                "token_ids": ids + toks,
                                "topk": 20,
                                "rows": rows,
                            },
                            g,
                            ensure_ascii=False,
                        )
                print(f"{p['name']}: {len(ids)} prompt tokens, min margin {min(margins):.4f}", file=sys.stderr)
        if args.skip_ppl:
            return
    else:
        model = Model(model_path)
    tokens = llama_tokenize_file(args.llama_tokenize, model_path, GPL3)
    res = perplexity(model, tokens, 512)
    with open(GPL3, "rb") as f:
        text = f.read()
    res = {
        "text": GPL3,
        "text_bytes": len(text),
        "text_sha256": hashlib.sha256(text).hexdigest(),
        "ctx": 512,
        "bos": None,
        "n_tokens": len(tokens),
        **res,
    }
    with open(f"{args.outdir}/perplexity.json", "w", encoding="utf-8") as f:
        json.dump(res, f, indent=1)
        f.write("\n")
    print(f"perplexity {res['ppl']:.10f} over {res['windows']} windows", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    a = sub.add_parser("info")
    a.add_argument("model")
    a = sub.add_parser("check-llama")
    a.add_argument("model")
    a.add_argument("refdir")
    a.add_argument("--top20", nargs="*", default=["capital", "code"])
    a = sub.add_parser("refs")
    a.add_argument("model")
    a.add_argument("outdir")
    a.add_argument("--llama-tokenize", required=True)
    a.add_argument("--skip-ppl", action="store_true")
    a.add_argument("--only-ppl", action="store_true")
    args = ap.parse_args()
    {"info": cmd_info, "check-llama": cmd_check_llama, "refs": cmd_refs}[args.cmd](args)


if __name__ == "__main__":
    main()
