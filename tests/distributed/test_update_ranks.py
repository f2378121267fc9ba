"""N ranks compute the update one rank would, and checkpoints move between world sizes.

Each rank is a real process started by torch's launcher (gloo, float32), the model is sharded
with FSDP2, and the samples split unevenly in count and tokens."""

from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rollover.distributed.split import balanced_split
from rollover.training.samples import Sample

pytestmark = pytest.mark.slow  # two launches of real ranks, ~10 s each

WORKER = Path(__file__).with_name("update_worker.py")
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from transformers import LlamaConfig, LlamaForCausalLM

    from rollover.modelzoo.tiny import build_tiny_tokenizer

    folder = tmp_path_factory.mktemp("tiny-policy")
    tokenizer = build_tiny_tokenizer(folder, vocab_size=300)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=4,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def uneven_samples(vocab: int) -> list[Sample]:
    """7 samples (odd, so 2 ranks cannot split them evenly) of very different lengths."""
    rng = random.Random(1)
    samples = []
    for i, length in enumerate([5, 31, 9, 17, 4, 23, 12]):
        ids = [rng.randrange(3, vocab) for _ in range(length)]
        prompt = 2
        mask = [0] * prompt + [1] * (length - prompt)
        behaviour = [0.0] * prompt + [-rng.uniform(0.5, 4.0) for _ in range(length - prompt)]
        sample = Sample(f"r{i}", f"g{i // 2}", ids, mask, behaviour, [0] * length, reward=float(i % 2))
        sample.advantage = 1.0 if i % 2 else -1.0
        samples.append(sample)
    return samples


def launch(n_ranks: int, *args: str | Path) -> None:
    """`update_worker.main(*args)` on `n_ranks` ranks; one rank runs here, in this process
    (no launcher, no process group: the single-process run's code path)."""
    if n_ranks == 1:
        from tests.distributed import update_worker

        update_worker.main(*map(str, args))
        return
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={n_ranks}"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run(
        [*command, str(WORKER), *map(str, args)], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-4000:]


def relative_difference(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).norm() / a[k].norm().clamp_min(1e-12)).item() for k in a)


@pytest.fixture(scope="module")
def updates(model_dir, tmp_path_factory):
    """The same update on 1 rank and on 2 ranks: their work folders."""
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(model_dir))
    folders = {}
    for n_ranks in (1, 2):
        work = tmp_path_factory.mktemp(f"update-{n_ranks}")
        (work / "samples.pkl").write_bytes(pickle.dumps((uneven_samples(vocab), 7)))
        launch(n_ranks, model_dir, work, "update")
        folders[n_ranks] = work
    return folders


def test_two_ranks_take_the_step_one_rank_takes(updates, model_dir):
    from safetensors.torch import load_file

    initial = load_file(model_dir / "model.safetensors")
    one, two = (torch.load(updates[n] / "weights.pt") for n in (1, 2))
    moved = relative_difference({k: initial[k] for k in one}, one)
    assert moved > 1e-3, "the update must move the weights for the comparison to mean anything"
    assert relative_difference(one, two) < 1e-5
    metrics_one, metrics_two = (pickle.loads((updates[n] / "metrics.pkl").read_bytes()) for n in (1, 2))
    assert metrics_one.keys() == metrics_two.keys()
    for key in ("actor/pg_loss", "actor/ppo_kl", "actor/grad_norm"):
        assert metrics_two[key] == pytest.approx(metrics_one[key], rel=1e-4, abs=1e-7), key


@pytest.mark.parametrize(("saved_on", "loaded_on"), [(2, 1), (1, 2)])
def test_checkpoint_loads_on_another_number_of_ranks(updates, model_dir, tmp_path, saved_on, loaded_on):
    launch(loaded_on, model_dir, tmp_path, "load", updates[saved_on] / "state")
    saved = torch.load(updates[saved_on] / "weights.pt")
    assert relative_difference(saved, torch.load(tmp_path / "weights.pt")) < 1e-6
    moments = torch.load(tmp_path / "exp_avg.pt")
    assert moments and all(m.abs().sum() > 0 for m in moments.values()), "the optimizer state came back"


def test_balanced_split_keeps_order_and_evens_tokens():
    lengths = [5, 31, 9, 17, 4, 23, 12]
    parts = balanced_split(lengths, 2)
    assert sorted(i for part in parts for i in part) == list(range(7))
    assert all(part == sorted(part) for part in parts)
    loads = [sum(lengths[i] for i in part) for part in parts]
    assert abs(loads[0] - loads[1]) <= max(lengths) // 2
    assert balanced_split(lengths, 1) == [list(range(7))]
    assert balanced_split([3], 2) == [[0], []]
