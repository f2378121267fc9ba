"""LoRA on a real (tiny) transformer folder: only the adapter trains and is saved; the KL
reference is the base with the adapter off; checkpoints restore the adapter and its Adam state;
a merged export is a plain model with the adapted logprobs."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from rollover import adapter_folder
from rollover.cli.main import main
from rollover.config import ConfigError, load_config
from rollover.training.actor import Actor
from rollover.training.samples import RolloutScore, Sample, UpdateBatch
from rollover.training.update_settings import ActorSettings
from tests.distributed.test_update_ranks import model_dir

LORA = ["actor_rollout_ref.model.lora_rank=4", "actor_rollout_ref.model.lora_alpha=8"]
__all__ = ["model_dir"]  # the tiny policy folder, shared with test_update_ranks and test_policies
pytestmark = pytest.mark.slow  # a tokenizer and several policies built, ~10 s a test on 2 cores

BASE = [
    "trainer.device=cpu",
    "actor_rollout_ref.actor.optim.lr=5e-2",
    "actor_rollout_ref.actor.policy_loss.loss_mode=vanilla",
    "actor_rollout_ref.rollout.n=2",
]


def batch() -> UpdateBatch:
    rng = random.Random(3)
    samples = []
    for i, length in enumerate([9, 14, 7, 12]):
        ids = [rng.randrange(3, 290) for _ in range(length)]
        mask = [0, 0] + [1] * (length - 2)
        samples.append(Sample(f"r{i}", f"g{i // 2}", ids, mask, [0.0] * length, [0] * length, float(i % 2)))
    rollouts = [RolloutScore(s.rollout_id, s.group_id, s.reward) for s in samples]
    return UpdateBatch(samples, rollouts)


def logprobs(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0, :-1].log_softmax(-1).gather(1, torch.tensor([ids[1:]]).T)[:, 0]


def base_model(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def trained_policy(model_dir: Path, *extra: str) -> Actor:
    policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*BASE, *LORA, *extra])))
    policy.update(batch(), random.Random(0), lr=5e-2)
    return policy


def test_only_the_adapter_trains(model_dir):
    policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*BASE, *LORA])))
    ids = batch().samples[1].input_ids
    # A fresh adapter's B is zero: the policy starts as the base model.
    assert torch.allclose(logprobs(policy.model, ids), logprobs(base_model(model_dir), ids), atol=1e-6)
    names = {id(p): n for n, p in policy.model.named_parameters()}
    optimized = [names[id(p)] for group in policy.optimizer.param_groups for p in group["params"]]
    assert optimized and all("lora_" in n for n in optimized)
    frozen_before = {n: p.detach().clone() for n, p in policy.model.named_parameters() if "lora_" not in n}
    policy.update(batch(), random.Random(0), lr=5e-2)
    after = dict(policy.model.named_parameters())
    assert all(torch.equal(frozen_before[n], after[n]) for n in frozen_before), "a base weight moved"
    assert any(after[n].abs().sum() > 0 for n in optimized if "lora_B" in n), "the adapter did not move"
    assert not torch.allclose(logprobs(policy.model, ids), logprobs(base_model(model_dir), ids), atol=1e-4)


def test_the_kl_reference_is_the_base_with_the_adapter_off(model_dir):
    policy = trained_policy(model_dir, "actor_rollout_ref.actor.use_kl_loss=true")
    assert isinstance(policy.reference, lora_reference_type())
    assert policy.reference.model is policy.model  # no second model
    samples = batch().samples
    refs = policy.reference.logprobs(samples, policy.pad_token_id, 1.0)
    base = base_model(model_dir)
    for sample, ref in zip(samples, refs):
        assert torch.allclose(ref, logprobs(base, sample.input_ids), atol=1e-5)
        assert not torch.allclose(ref, logprobs(policy.model, sample.input_ids), atol=1e-4)  # the adapter is back on


def lora_reference_type() -> type:
    from rollover.training.reference import AdapterOffReference

    return AdapterOffReference


def test_the_checkpoint_is_the_adapter_and_its_optimizer_state(model_dir, tmp_path):
    policy = trained_policy(model_dir)
    policy.save_training_state(tmp_path / "state")
    # Fresh policy: the adapter and Adam's moments come back from the checkpoint.
    resumed = Actor.load(model_dir, ActorSettings.from_config(load_config(None, [*BASE, *LORA])))
    resumed.load_training_state(tmp_path / "state")
    for (name, saved), (_, loaded) in zip(policy.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(saved, loaded), name
    saved_moments = [s["exp_avg"] for s in policy.optimizer.state.values()]
    loaded_moments = [s["exp_avg"] for s in resumed.optimizer.state.values()]
    assert len(saved_moments) == len(loaded_moments) > 0
    assert all(torch.equal(a, b) for a, b in zip(saved_moments, loaded_moments))
    # The base is not training state: the checkpoint holds the adapter's tensors alone.
    from torch.distributed.checkpoint import FileSystemReader

    saved_keys = FileSystemReader(str(tmp_path / "state")).read_metadata().state_dict_metadata
    model_keys = [k for k in saved_keys if k.startswith("model.")]
    assert model_keys and all("lora_" in k for k in model_keys), [k for k in model_keys if "lora_" not in k]


def test_save_writes_the_adapter_and_merge_gives_a_plain_model_with_its_logprobs(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    policy = trained_policy(model_dir)
    saved = policy.save(tmp_path / "checkpoint" / "model")
    assert {p.name for p in saved.iterdir()} >= {adapter_folder.ADAPTER_CONFIG, adapter_folder.ADAPTER_WEIGHTS}
    assert not (saved / "model.safetensors").exists()  # the base is not copied
    # `rollover model merge RUN_DIR/checkpoints/step_N --out DIR`
    assert main(["model", "merge", str(tmp_path / "checkpoint"), "--out", str(tmp_path / "merged")]) == 0
    merged_dir = tmp_path / "merged"
    assert not (merged_dir / adapter_folder.ADAPTER_CONFIG).exists()
    merged = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    assert "lora" not in " ".join(n for n, _ in merged.named_parameters())
    for sample in batch().samples:
        assert torch.allclose(logprobs(merged, sample.input_ids), logprobs(policy.model, sample.input_ids), atol=1e-5)
    assert main(["model", "merge", str(model_dir), "--out", str(tmp_path / "nothing")]) == 2  # no adapter there


def test_every_save_is_peft_s_own_state_of_the_adapter_as_it_is_now(model_dir):
    """`adapter_state_dict` keeps PEFT's names from the first save: every later one still gives
    exactly what PEFT gives, with the adapter's current values."""
    from peft import get_peft_model_state_dict

    from rollover.training import lora

    policy = trained_policy(model_dir)
    names = lora.SavedNames()
    for _ in range(2):  # the first save asks PEFT, the next reuses its names
        state = lora.adapter_state_dict(policy.model, keep=True, names=names)
        assert len(names.known) == 1 and None not in names.known.values()  # learnt a renaming
        expected = get_peft_model_state_dict(policy.model)
        assert list(state) == list(expected)
        assert all(torch.equal(state[k], expected[k]) for k in expected)
        assert lora.adapter_state_dict(policy.model, keep=False, names=names) == {}
        policy.update(batch(), random.Random(1), lr=5e-2)  # the adapter moves
    moved = next(k for k in state if "lora_B" in k)
    assert not torch.equal(state[moved], get_peft_model_state_dict(policy.model)[moved])  # a copy, not the live tensor


def test_a_run_starts_from_an_existing_adapter(model_dir, tmp_path):
    policy = trained_policy(model_dir)
    adapter = policy.save(tmp_path / "adapter")
    started = Actor.load(
        model_dir,
        ActorSettings.from_config(
            load_config(None, [*BASE, *LORA, f"actor_rollout_ref.model.lora_adapter_path={adapter}"])
        ),
    )
    ids = batch().samples[2].input_ids
    assert torch.allclose(logprobs(started.model, ids), logprobs(policy.model, ids), atol=1e-6)
    assert any(p.requires_grad for p in started.model.parameters())  # it trains on
    with pytest.raises(ConfigError, match=r"actor_rollout_ref\.model\.lora_rank.*rank of the adapter.*\(4\)"):
        Actor.load(
            model_dir,
            ActorSettings.from_config(
                load_config(
                    None,
                    [
                        *BASE,
                        "actor_rollout_ref.model.lora_rank=8",
                        f"actor_rollout_ref.model.lora_adapter_path={adapter}",
                    ],
                )
            ),
        )


def test_without_lora_the_policy_is_the_whole_model(model_dir):
    policy = Actor.load(model_dir, ActorSettings.from_config(load_config(None, BASE)))
    assert not policy.lora
    n_optimized = sum(p.numel() for group in policy.optimizer.param_groups for p in group["params"])
    assert n_optimized == sum(p.numel() for p in policy.model.parameters())
