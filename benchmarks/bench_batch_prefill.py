"""Prefill of R prompts together: per-request prefill (the default) against the batched
program, side by side, with decode tokens/s apart from prefill.

For each R, the same R GSM8K prompts (chat template; prompts 200.. of
benchmarks/data/gsm8k.jsonl) are generated greedily with `--new-tokens` new tokens, once per
mode to compile, then `--repeats` rounds interleaved (the mode order alternates). Reported:
median (min–max) of `stats["prefill_s"]`, prefill of R together ÷ R × prefill of one, and
decode tokens/s (the R × (new − 1) tokens after the first, ÷ `decode_s`). Outputs of the two
modes are checked identical.

`--hf` adds HF transformers' batched `generate` on the same GGUF and prompts (torch CPU,
fp32, left padding, greedy, 2 threads) in the same interleaved rounds: its prefill is a
`generate` of one new token, its decode tok/s is R × (new − 1) ÷ (the full generate − that
prefill). Needs the `parity` extra.

    python -m benchmarks.bench_batch_prefill [--requests 1,4,16,64] [--repeats 3] [--new-tokens 32] [--hf]
"""

from __future__ import annotations

import argparse
import json
import os
import time

import dspark_jax as ds
from benchmarks.common import eval_prompts, hardware, machine_load, median, spread, table


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", default="1,4,16,64")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--json", default=None, help="write the raw timings here")
    ap.add_argument("--batched-up-to", type=int, default=1 << 30,
                    help="run the batched program only up to this many requests (it grows with R²)")
    ap.add_argument("--hf", action="store_true", help="add HF transformers' batched generate (parity extra)")
    ap.add_argument("--weight-dtype", default=None, help="bfloat16: our target's weights in bf16, float32 arithmetic")
    ap.add_argument("--hf-dtype", default="float32", help="HF's torch dtype (float32 | bfloat16)")
    args = ap.parse_args(argv)
    target = ds.load_target("smollm2-135m", weight_dtype=args.weight_dtype)
    hf = HFGenerate(args.new_tokens, dtype=args.hf_dtype) if args.hf else None
    rs = [int(x) for x in args.requests.split(",")]
    prompts = [[{"role": "user", "content": p}] for p in eval_prompts("gsm8k", 200 + max(rs))[200:]]
    sp = ds.SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    print(f"# {hardware()}; {machine_load()} at start; our weights {args.weight_dtype or 'float32'}, "
          f"HF {args.hf_dtype if args.hf else '-'}")
    rows, raw, one = [], {}, {}
    for R in rs:
        ps = prompts[:R]
        modes = {"per-request": False, "batched": True} if R <= args.batched_up_to else {"per-request": False}
        outs = {m: ds.generate(target, ps, sampling=sp, batched_prefill=b) for m, b in modes.items()}  # compile
        assert len({str(o.token_ids) for o in outs.values()}) == 1  # the modes agree
        if hf is not None:
            modes["HF transformers"] = None
            hf(ps)  # warm-up
        pre = {m: [] for m in modes}
        dec = {m: [] for m in modes}
        for r in range(args.repeats):
            for m in (list(modes) if r % 2 == 0 else list(modes)[::-1]):
                if modes[m] is None:
                    p_s, d_s = hf(ps)
                else:
                    st = ds.generate(target, ps, sampling=sp, batched_prefill=modes[m]).stats
                    p_s, d_s = st["prefill_s"], st["decode_s"]
                pre[m].append(p_s)
                dec[m].append(R * (args.new_tokens - 1) / d_s)
        raw[R] = {"prefill_s": pre, "decode_tok_s": dec}
        if R == 1:
            one = {m: median(v) for m, v in pre.items()}
        for m in modes:
            ratio = median(pre[m]) / (R * one[m]) if one else float("nan")
            rows.append([R, m, spread(pre[m]), f"{ratio:.2f}", spread(dec[m], fmt="{:.1f}")])
        print(table(["requests", "prefill", "prefill s, median (min–max)", "÷ R × one prompt",
                     "decode tok/s"], rows[-len(modes):]), flush=True)
    print(f"\n## Prefill of R prompts together ({args.repeats} interleaved rounds, {args.new_tokens} new tokens)\n")
    print(table(["requests", "prefill", "prefill s, median (min–max)", "÷ R × one prompt", "decode tok/s"], rows))
    print(f"\n{machine_load()} at end")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(raw, f, indent=1)


class HFGenerate:
    """HF transformers' batched greedy `generate` on the embedded GGUF: (prefill s, decode s)."""

    def __init__(self, new_tokens: int, threads: int = 2, dtype: str = "float32"):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from dspark_jax.io.loading import embedded_path

        torch.set_num_threads(threads)
        d, f = os.path.split(embedded_path("smollm2-135m"))
        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, dtype=getattr(torch, dtype)).eval()
        self.tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
        self.tok.padding_side = "left"
        if self.tok.pad_token is None:
            self.tok.pad_token = self.tok.eos_token
        self.new_tokens = new_tokens

    def _generate(self, batch, n):
        t0 = time.perf_counter()
        with self.torch.inference_mode():
            self.model.generate(**batch, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                pad_token_id=self.tok.pad_token_id)
        return time.perf_counter() - t0

    def __call__(self, chats):
        texts = [self.tok.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in chats]
        batch = self.tok(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        prefill = self._generate(batch, 1)
        full = self._generate(batch, self.new_tokens)
        return prefill, max(full - prefill, 1e-9)


if __name__ == "__main__":
    main()
