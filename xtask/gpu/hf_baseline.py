"""Hugging Face baseline for the te-rs GPU check (run by run.sh, step 4).

The workload of TransformerEngine's Gemma generation tutorial on the
PyTorch and `transformers` of the machine: `GemmaForCausalLM` randomly
initialised from the same config.json te-rs's `random:gemma-7b` uses, in
bf16 on the GPU, greedy generation with a static KV cache; `--batch`
prompts of `--prompt-len` random token ids, exactly `--new-tokens` new
tokens each. Each timed run follows an identical warm-up run (CUDA
synchronised around it). Then decode tokens/s at each of `--decode-batches`.

`--dry-run` prints the plan without importing torch (it runs anywhere);
`--out FILE` writes one JSON object: workload_s, decode_tokens_per_s
(batch -> tokens/s), and the settings.
"""

import argparse
import json
import sys
import time


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True, help="Hugging Face config.json")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=20)
    p.add_argument("--new-tokens", type=int, default=492)
    p.add_argument("--decode-batches", default="1,8,64",
                   help="comma-separated batch sizes for the decode tokens/s figures")
    p.add_argument("--decode-tokens", type=int, default=128,
                   help="tokens generated per sequence in each decode measurement")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the results as one JSON object here")
    p.add_argument("--dry-run", action="store_true", help="print the plan; import nothing")
    args = p.parse_args(argv)
    args.decode_batches = [int(b) for b in args.decode_batches.split(",") if b]
    return args


def plan(args, config):
    print(f"hf_baseline: {config.get('architectures', ['?'])[0]} from {args.config}: "
          f"{config['num_hidden_layers']} layers, hidden {config['hidden_size']}, "
          f"vocab {config['vocab_size']}")
    print(f"   plan: random init (seed {args.seed}) in bf16 on cuda, static KV cache, greedy")
    print(f"   plan: workload batch {args.batch} x ({args.prompt_len} prompt + "
          f"{args.new_tokens} new tokens), one warm-up run, then timed")
    print(f"   plan: decode tokens/s at batch {', '.join(map(str, args.decode_batches))} "
          f"({args.decode_tokens} new tokens each)")


def generate_seconds(torch, model, batch, prompt_len, new_tokens, vocab):
    """Wall seconds of one greedy generate of exactly `new_tokens` tokens,
    after an identical warm-up: with a static cache, `generate` compiles
    the model (torch.compile) for each batch size and cache length, and
    that compile stays out of the timed run."""
    seconds = None
    for _ in range(2):
        ids = torch.randint(3, vocab, (batch, prompt_len), device="cuda")
        mask = torch.ones_like(ids)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False,
                             cache_implementation="static", pad_token_id=0)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        assert out.shape == (batch, prompt_len + new_tokens), out.shape
    return seconds


def main(argv):
    args = parse_args(argv)
    with open(args.config) as f:
        config_dict = json.load(f)
    plan(args, config_dict)
    if args.dry_run:
        return 0

    import torch
    from transformers import GemmaConfig, GemmaForCausalLM

    if not torch.cuda.is_available():
        print("hf_baseline: torch sees no CUDA device", file=sys.stderr)
        return 1
    torch.manual_seed(args.seed)
    config = GemmaConfig.from_dict(config_dict)
    # Built in bf16 directly on the GPU: no f32 copy of the 8.5B weights.
    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        model = GemmaForCausalLM(config)
    torch.set_default_dtype(torch.float32)
    model.eval()
    vocab = config.vocab_size
    with torch.inference_mode():
        workload_s = generate_seconds(torch, model, args.batch, args.prompt_len,
                                      args.new_tokens, vocab)
        print(f"hf_baseline: workload {workload_s:.2f} s")
        decode = {}
        for b in args.decode_batches:
            prefill_s = generate_seconds(torch, model, b, args.prompt_len, 1, vocab)
            total_s = generate_seconds(torch, model, b, args.prompt_len, args.decode_tokens, vocab)
            # The decode steps alone: one-token generate (the prefill) taken out.
            decode[b] = b * (args.decode_tokens - 1) / max(total_s - prefill_s, 1e-9)
            print(f"hf_baseline: decode batch {b}: {decode[b]:.1f} tokens/s")
    result = {
        "workload_s": workload_s,
        "decode_tokens_per_s": decode,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
