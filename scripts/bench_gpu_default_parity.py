"""Greedy parity of the default model on a GPU: fast path vs eager path vs HF transformers float32.

The 12 chat prompts of the parity test, 48 new tokens each, submitted concurrently through the SDK
to ``forerun serve --device cuda`` (bfloat16) twice: with the fast path (Triton kernels, CUDA
graphs) and with the eager torch path (``--kernels torch --no-cuda-graphs``). The reference is HF
transformers' greedy ``generate`` on the same GGUF file in float32 on the same GPU.

Where a forerun sequence differs from HF's, HF's float32 logits at the first differing position
say whether the top two candidates were within bfloat16 rounding of each other
(|l1 - l2| <= 2**-7 * max(|l1|, |l2|), one bf16 ulp of the larger), which is then a tie that
bf16 is entitled to break either way.

    python3 scripts/bench_gpu_default_parity.py --json out.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import tempfile

import torch

from _bench_util import CHAT_PROMPTS, start_server, stop_server
from executor_proc.model.default_model import default_gguf_path, ensure_default_model
from ipc.client import AsyncClient

NEW_TOKENS = 48


async def forerun_greedy(address: str, prompts: list[list[int]]) -> list[list[int]]:
    async with AsyncClient(address, timeout=300) as c:
        rs = await asyncio.gather(*[c.generate(prompt_token_ids=ids, max_tokens=NEW_TOKENS, temperature=0.0,
                                               detokenize=False) for ids in prompts])
    return [r.token_ids for r in rs]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, metavar="PATH", help="write the comparison as JSON")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_default_model()
    tok = AutoTokenizer.from_pretrained(folder)
    prompts = []
    for text in CHAT_PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    gguf = default_gguf_path()
    hf = AutoModelForCausalLM.from_pretrained(os.path.dirname(gguf), gguf_file=os.path.basename(gguf),
                                              dtype=torch.float32).cuda().eval()
    ref = []
    with torch.inference_mode():
        for ids in prompts:
            x = torch.tensor([ids], device="cuda")
            y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=NEW_TOKENS, do_sample=False,
                            eos_token_id=2, pad_token_id=2)
            ref.append(y[0, len(ids):].tolist())

    def first_diff_margin(i: int, ours: list[int]) -> dict:
        n = next((k for k, (a, b) in enumerate(zip(ours, ref[i])) if a != b), min(len(ours), len(ref[i])))
        with torch.inference_mode():
            logits = hf(torch.tensor([prompts[i] + ref[i][:n]], device="cuda")).logits[0, -1].float()
        top = torch.topk(logits, 2).values.tolist()
        margin = top[0] - top[1]
        return {"request": i, "position": n, "margin": margin,
                "within_bf16_rounding": margin <= 2**-7 * max(abs(top[0]), abs(top[1]))}

    report = {}
    for name, extra in (("fast", []), ("eager", ["--kernels", "torch", "--no-cuda-graphs"])):
        address = f"ipc://{tempfile.mkdtemp(prefix='frp', dir='/tmp')}/c.sock"
        proc = start_server(address, "--device", "cuda", *extra)
        try:
            ours = asyncio.run(forerun_greedy(address, prompts))
        finally:
            stop_server(proc)
        diffs = [first_diff_margin(i, o) for i, o in enumerate(ours) if o != ref[i]]
        report[name] = {"tokens": ours, "identical_to_hf": len(prompts) - len(diffs), "differences": diffs}
    fast, eager = report["fast"]["tokens"], report["eager"]["tokens"]
    report["fast_equals_eager"] = sum(a == b for a, b in zip(fast, eager))
    print(f"{'path':<6} {'= HF fp32':>10} {'differ':>7} {'ties (bf16)':>12}")
    for name in ("fast", "eager"):
        r = report[name]
        ties = sum(d["within_bf16_rounding"] for d in r["differences"])
        print(f"{name:<6} {r['identical_to_hf']:>7}/{len(prompts)} {len(r['differences']):>7} {ties:>12}")
    print(f"fast == eager: {report['fast_equals_eager']}/{len(prompts)}")
    for name in ("fast", "eager"):
        for d in report[name]["differences"]:
            print(f"  {name}: request {d['request']} first differs at token {d['position']}, "
                  f"HF top-2 margin {d['margin']:.4f} ({'a bf16 tie' if d['within_bf16_rounding'] else 'NOT a tie'})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
