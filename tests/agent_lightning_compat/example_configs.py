"""Agent Lightning 1.0's six example training configs, as data: what each example's
`verl_default_config()` returns (examples/{calc_x,gsm8k,science_world,swe_smith,search_r1,
llm-in-sandbox}/train_*.py), key for key and value for value, and Agent Lightning's base config
(agentlightning/verl/config.yaml) under them. Agent Lightning composes the run's config as
`OmegaConf.merge(base, example)`: `agl_config(name)` does the same.

A value Agent Lightning computes (a model constant, a path in the example's folder) is written
here as the literal it comes to, with a comment naming the expression.

`scaled_down` makes one of them runnable on this CPU machine: it changes only where the run
happens and how big it is (`SCALED_KEYS`: model, tasks, batch and token budgets, devices, the
gateway's address, the agent, loggers, the engine's CPU settings), never the maths (clip
ratios, KL, loss aggregation, bypass, entropy, the learning rate and its schedule, group size).

Over 600 lines because it is a transcription: seven configs written out in full.
"""

from __future__ import annotations

import copy
import math
from pathlib import Path
from typing import Any

import yaml

# agentlightning/verl/config.yaml (agentlightning 1.0.2), the base every example merges over.
BASE: dict[str, Any] = {
    "hydra": {"searchpath": ["pkg://verl/trainer/config"]},
    "defaults": ["ppo_trainer", "_self_"],
    "algorithm": {"enable_rollout_level_advantage": True},
    "agentlightning": {
        "agl_base_url": "http://localhost:8080",
        "agl_key": "",
        "hooks": None,
        "rollout_timeout_seconds": 1800,
        "local": {"agent_class": None, "env_map": {}},
        "k8s": {"job_template_path": None},
        "reward_fillna_value": 0.0,
        "max_ppo_update_times": None,
        "trace_aggregator": {
            "level": "trajectory",
            "trajectory_max_prompt_length": 2048,
            "trajectory_max_response_length": 8192,
        },
        "async_rollout": {"enabled": False, "async_train_batch_size": None},
    },
    "data": {"filter_overlong_prompts": False},
    "actor_rollout_ref": {
        "actor": {"calculate_entropy": True, "policy_loss": {"loss_mode": "per_rollout_mean"}},
        "rollout": {"mode": "async"},
    },
}


CALC_X: dict[str, Any] = {
    "algorithm": {
        "adv_estimator": "grpo",
        "use_kl_in_reward": False,
    },
    "data": {
        "train_batch_size": 32,
        "max_prompt_length": 4096,
        "max_response_length": 2048,
    },
    "actor_rollout_ref": {
        "rollout": {
            "tensor_model_parallel_size": 1,
            "n": 4,
            "log_prob_micro_batch_size_per_gpu": 4,
            "multi_turn": {
                "format": "hermes",
            },
            "name": "vllm",
            "gpu_memory_utilization": 0.6,
            "engine_kwargs": {
                "vllm": {
                    "enable_auto_tool_choice": True,
                    "tool_call_parser": "hermes",
                },
            },
        },
        "actor": {
            "ppo_mini_batch_size": 32,
            "ppo_micro_batch_size_per_gpu": 4,
            "optim": {
                "lr": 1e-06,
            },
            "use_kl_loss": False,
            "kl_loss_coef": 0.0,
            "entropy_coeff": 0,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.3,
            "fsdp_config": {
                "param_offload": True,
                "optimizer_offload": True,
            },
        },
        "ref": {
            "log_prob_micro_batch_size_per_gpu": 8,
            "fsdp_config": {
                "param_offload": True,
            },
        },
        "model": {
            "path": "Qwen/Qwen2.5-1.5B-Instruct",
            "use_remove_padding": True,
            "enable_gradient_checkpointing": True,
        },
    },
    "trainer": {
        "n_gpus_per_node": 1,
        "val_before_train": False,
        "critic_warmup": 0,
        "logger": ["console", "wandb"],
        "project_name": "agentlightning",
        "experiment_name": "calc_x",
        "nnodes": 1,
        "save_freq": 64,
        "test_freq": 10,
        "total_epochs": 2,
    },
    "agentlightning": {
        "agl_base_url": "http://localhost:8181",
        "agl_key": "calcx-dev-key",
        "rollout_timeout_seconds": 300,
        "async_rollout": {
            "enabled": False,
            "async_train_batch_size": 64,
        },
        "local": {
            "agent_class": "examples.calc_x.calc_agent.Agent",
            "env_map": {
                "QUESTION": "input.question",
                "RESULT": "input.result",
            },
        },
        "k8s": {
            # Agent Lightning writes str(example_dir / 'job-template.yaml') (a path in the example's folder)
            "job_template_path": "examples/calc_x/job-template.yaml",
        },
    },
}


GSM8K: dict[str, Any] = {
    "algorithm": {
        "adv_estimator": "grpo",
        "use_kl_in_reward": False,
    },
    "data": {
        "train_batch_size": 8,
        "max_prompt_length": 2048,
        "max_response_length": 1024,
    },
    "actor_rollout_ref": {
        "rollout": {
            "tensor_model_parallel_size": 1,
            "n": 4,
            "log_prob_micro_batch_size_per_gpu": 1,
            "multi_turn": {
                "format": "hermes",
            },
            "name": "vllm",
            "gpu_memory_utilization": 0.6,
        },
        "actor": {
            "ppo_mini_batch_size": 8,
            "ppo_micro_batch_size_per_gpu": 1,
            "optim": {
                "lr": 1e-06,
            },
            "use_kl_loss": False,
            "kl_loss_coef": 0.0,
            "entropy_coeff": 0,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "fsdp_config": {
                "param_offload": True,
                "optimizer_offload": True,
            },
        },
        "ref": {
            "log_prob_micro_batch_size_per_gpu": 1,
            "fsdp_config": {
                "param_offload": True,
            },
        },
        "model": {
            "path": "Qwen/Qwen2.5-1.5B-Instruct",
            "use_remove_padding": True,
            "enable_gradient_checkpointing": True,
        },
    },
    "trainer": {
        "n_gpus_per_node": 1,
        "val_before_train": False,
        "critic_warmup": 0,
        "logger": ["console", "wandb"],
        "project_name": "agentlightning",
        "experiment_name": "gsm8k",
        "nnodes": 1,
        "save_freq": -1,
        "test_freq": 10,
        "total_epochs": 2,
    },
    "agentlightning": {
        "agl_base_url": "http://localhost:8181",
        "agl_key": "gsm8k-dev-key",
        "rollout_timeout_seconds": 300,
        "trace_aggregator": {
            "level": "trajectory",
            "trajectory_max_prompt_length": 1024,
            "trajectory_max_response_length": 1024,
        },
        "async_rollout": {
            "enabled": False,
            "async_train_batch_size": 64,
        },
        "local": {
            "agent_class": "examples.gsm8k.gsm8k_agent.ChatAgent",
            "env_map": {
                "QUESTION": "input.question",
                "ANSWER": "input.answer",
            },
        },
    },
}


LLM_IN_SANDBOX: dict[str, Any] = {
    "algorithm": {
        "adv_estimator": "rloo",
        "use_kl_in_reward": False,
    },
    "data": {
        "train_batch_size": 8,
        "max_prompt_length": 65536,
        "max_response_length": 65536,
        "truncation": "error",
    },
    "actor_rollout_ref": {
        "rollout": {
            "mode": "async",
            "tensor_model_parallel_size": 1,
            "n": 8,
            "log_prob_micro_batch_size_per_gpu": 1,
            "multi_turn": {
                "format": "hermes",
            },
            "name": "vllm",
            "gpu_memory_utilization": 0.7,
            "max_model_len": 65536,
            "enforce_eager": True,
            "engine_kwargs": {
                "vllm": {
                    "enable_auto_tool_choice": True,
                    "tool_call_parser": "hermes",
                },
            },
            "temperature": 1,
            "val_kwargs": {
                "temperature": 0,
                "do_sample": False,
            },
            "enable_prefix_caching": True,
            "enable_chunked_prefill": False,
        },
        "actor": {
            "ppo_mini_batch_size": 8,
            "ppo_micro_batch_size_per_gpu": 1,
            "optim": {
                "lr": 1e-06,
            },
            "use_kl_loss": False,
            "kl_loss_type": "low_var_kl",
            "kl_loss_coef": 0.001,
            "entropy_coeff": 0,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "fsdp_config": {
                "param_offload": True,
                "optimizer_offload": True,
            },
            "loss_agg_mode": "seq-mean-token-sum",
        },
        "ref": {
            "log_prob_micro_batch_size_per_gpu": 1,
            "fsdp_config": {
                "param_offload": True,
            },
        },
        "model": {
            # Agent Lightning writes DEFAULT_MODEL (the example's DEFAULT_MODEL)
            "path": "Qwen/Qwen3-4B-Instruct-2507",
            "use_remove_padding": True,
            "enable_gradient_checkpointing": True,
        },
    },
    "trainer": {
        "n_gpus_per_node": 4,
        "val_before_train": False,
        "critic_warmup": 0,
        "logger": ["console", "wandb"],
        "project_name": "AgentLightning-k8s",
        "experiment_name": "train_llm_in_sandbox_new_code",
        "nnodes": 1,
        "test_freq": 20,
        "save_freq": 20,
        "total_epochs": 15,
        "total_training_steps": 1000,
    },
    "agentlightning": {
        "agl_base_url": "http://localhost:8080",
        "agl_key": "",
        "rollout_timeout_seconds": 1500,
        "reward_fillna_value": 0.0,
        "trace_aggregator": {
            "level": "trajectory",
            "trajectory_max_prompt_length": 8000,
            "trajectory_max_response_length": 12000,
        },
        "k8s": {
            # Agent Lightning writes str(example_dir / 'job-template.yaml') (a path in the example's folder)
            "job_template_path": "examples/llm-in-sandbox/job-template.yaml",
        },
    },
}


SCIENCE_WORLD: dict[str, Any] = {
    "algorithm": {
        "adv_estimator": "grpo",
        "use_kl_in_reward": False,
        "rollout_correction": {
            "bypass_mode": True,
            "loss_type": "ppo_clip",
            "rollout_is": None,
            "rollout_rs": None,
            "rollout_rs_threshold": None,
        },
    },
    "data": {
        "train_batch_size": 32,
        "max_prompt_length": 4096,
        "max_response_length": 1024,
    },
    "actor_rollout_ref": {
        "rollout": {
            "tensor_model_parallel_size": 2,
            "n": 4,
            "log_prob_micro_batch_size_per_gpu": 4,
            "name": "vllm",
            "gpu_memory_utilization": 0.5,
            "checkpoint_engine": {
                "update_weights_bucket_megabytes": 4096,
            },
        },
        "actor": {
            "ppo_mini_batch_size": 16,
            "ppo_micro_batch_size_per_gpu": 4,
            "ulysses_sequence_parallel_size": 2,
            "optim": {
                "lr": 1e-06,
            },
            "use_kl_loss": False,
            "kl_loss_coef": 0.0,
            "entropy_coeff": 0,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.3,
            "fsdp_config": {
                "param_offload": True,
                "optimizer_offload": True,
            },
        },
        "ref": {
            "log_prob_micro_batch_size_per_gpu": 8,
            "fsdp_config": {
                "param_offload": False,
            },
        },
        "model": {
            "path": "Qwen/Qwen2.5-7B-Instruct",
            "use_remove_padding": True,
            "enable_gradient_checkpointing": True,
        },
    },
    "trainer": {
        "n_gpus_per_node": 8,
        "val_before_train": False,
        "critic_warmup": 0,
        "logger": ["console", "wandb"],
        "project_name": "agentlightning",
        "experiment_name": "science_world",
        "nnodes": 1,
        "save_freq": 32,
        "test_freq": 16,
        "total_epochs": 1,
    },
    "agentlightning": {
        "agl_base_url": "http://localhost:8080",
        "agl_key": "",
        "rollout_timeout_seconds": 1800,
        "trace_aggregator": {
            "level": "trajectory",
            "trajectory_max_prompt_length": 4096,
            "trajectory_max_response_length": 1024,
        },
        "async_rollout": {
            "enabled": True,
            "async_train_batch_size": 48,
        },
        "local": {
            "agent_class": "examples.science_world.agents.sw_agent:SWAgent",
            "env_map": {
                "TASK_NAME": "input.task_name",
                "VARIATION_IDX": "input.variation_idx",
                "SIMPLIFICATION": "input.simplification",
            },
        },
    },
}


SEARCH_R1: dict[str, Any] = {
    "algorithm": {
        "adv_estimator": "grpo",
        "use_kl_in_reward": False,
    },
    "data": {
        "train_batch_size": 512,
        "max_prompt_length": 6000,
        "max_response_length": 4096,
        "truncation": "error",
    },
    "actor_rollout_ref": {
        "rollout": {
            "tensor_model_parallel_size": 1,
            "n": 4,
            "log_prob_micro_batch_size_per_gpu": 4,
            "multi_turn": {
                "format": "llama3_json",
            },
            "name": "vllm",
            "gpu_memory_utilization": 0.5,
            "max_model_len": 32768,
            "engine_kwargs": {
                "vllm": {
                    "enable_auto_tool_choice": True,
                    "tool_call_parser": "llama3_json",
                },
            },
        },
        "actor": {
            "ppo_mini_batch_size": 256,
            "ppo_micro_batch_size_per_gpu": 4,
            "optim": {
                "lr": 1e-06,
                "lr_warmup_steps_ratio": 0,
            },
            "use_kl_loss": True,
            "kl_loss_type": "low_var_kl",
            "kl_loss_coef": 0.001,
            "entropy_coeff": 0,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.3,
            "fsdp_config": {
                "param_offload": True,
                "optimizer_offload": True,
            },
        },
        "ref": {
            "log_prob_micro_batch_size_per_gpu": 4,
            "fsdp_config": {
                "param_offload": True,
            },
        },
        "model": {
            # Agent Lightning writes DEFAULT_MODEL (the example's DEFAULT_MODEL)
            "path": "meta-llama/Llama-3.2-3B-Instruct",
            "use_remove_padding": True,
            "enable_gradient_checkpointing": True,
        },
    },
    "trainer": {
        "n_gpus_per_node": 8,
        "val_before_train": True,
        "critic_warmup": 0,
        "logger": ["console", "wandb"],
        "project_name": "agentlightning",
        "experiment_name": "search_r1",
        "nnodes": 1,
        "test_freq": 10,
        "save_freq": 10,
        "total_epochs": 15,
        "total_training_steps": 300,
        "default_local_dir": "checkpoints/search_r1_checkpoints/",
    },
    "agentlightning": {
        "agl_base_url": "http://localhost:8080",
        "agl_key": "search-r1-dev-key",
        "rollout_timeout_seconds": 1800,
        "trace_aggregator": {
            "level": "trajectory",
            "trajectory_max_prompt_length": 4096,
            "trajectory_max_response_length": 34384,
        },
        "local": {
            "agent_class": "examples.search_r1.agents.search_r1_agent:SearchR1Agent",
            "env_map": {
                "QUESTION": "input.question",
                "GOLDEN_ANSWERS": "input.golden_answers",
            },
        },
    },
}


SWE_SMITH: dict[str, Any] = {
    "algorithm": {
        "adv_estimator": "grpo",
        "use_kl_in_reward": False,
    },
    "data": {
        "train_batch_size": 16,
        "max_prompt_length": 65536,
        "max_response_length": 65536,
        "truncation": "error",
    },
    "actor_rollout_ref": {
        "rollout": {
            "mode": "async",
            "tensor_model_parallel_size": 1,
            "n": 8,
            "log_prob_micro_batch_size_per_gpu": 1,
            "multi_turn": {
                "format": "hermes",
            },
            "name": "vllm",
            "gpu_memory_utilization": 0.8,
            "max_model_len": 81920,
            "max_num_batched_tokens": 8192,
            "enforce_eager": False,
            "engine_kwargs": {
                "vllm": {
                    "enable_auto_tool_choice": True,
                    "tool_call_parser": "hermes",
                    # Agent Lightning writes str(EXAMPLE_DIR / 'swe_smith_chat_template.jinja') (a path in the example's folder)
                    "chat_template": "examples/swe_smith/swe_smith_chat_template.jinja",
                    "moe_backend": "triton",
                },
            },
            "temperature": 1,
            "val_kwargs": {
                "temperature": 0.7,
                "do_sample": True,
            },
            "enable_prefix_caching": True,
            "enable_chunked_prefill": True,
            "checkpoint_engine": {
                "update_weights_bucket_megabytes": 4096,
            },
        },
        "actor": {
            "ppo_mini_batch_size": 16,
            "ppo_micro_batch_size_per_gpu": 1,
            "ppo_max_token_len_per_gpu": 16384,
            "optim": {
                "lr": 1e-06,
            },
            "use_kl_loss": False,
            "kl_loss_coef": 0.0,
            "entropy_coeff": 0,
            "clip_ratio_low": 0.2,
            "clip_ratio_high": 0.28,
            "fsdp_config": {
                "param_offload": True,
                "optimizer_offload": True,
                "entropy_from_logits_with_chunking": True,
            },
            "loss_agg_mode": "token-mean",
        },
        "ref": {
            "log_prob_micro_batch_size_per_gpu": 1,
            "fsdp_config": {
                "param_offload": True,
            },
        },
        "model": {
            # Agent Lightning writes DEFAULT_MODEL (the example's DEFAULT_MODEL)
            "path": "Qwen/Qwen3.5-9B",
            "use_remove_padding": True,
            "use_fused_kernels": True,
            "fused_kernel_options": {
                "impl_backend": "torch",
            },
            "enable_gradient_checkpointing": True,
        },
    },
    "trainer": {
        "n_gpus_per_node": 4,
        "val_before_train": True,
        "critic_warmup": 0,
        "logger": ["console", "wandb"],
        "project_name": "agentlightning",
        "experiment_name": "swe_smith",
        "nnodes": 1,
        "nccl_timeout": 1800,
        "test_freq": 16,
        "save_freq": 16,
        "total_epochs": 4,
        "total_training_steps": 1000,
    },
    "agentlightning": {
        "agl_base_url": "http://localhost:8080",
        "agl_key": "",
        "rollout_timeout_seconds": 5400,
        "reward_fillna_value": 0.0,
        "max_ppo_update_times": 2,
        "trace_aggregator": {
            "level": "trajectory",
            "trajectory_max_prompt_length": 65536,
            "trajectory_max_response_length": 65536,
        },
        "async_rollout": {
            "enabled": False,
            "async_train_batch_size": 50,
        },
        "k8s": {
            # Agent Lightning writes str(EXAMPLE_DIR / 'job-template-openai.yaml') (a path in the example's folder)
            "job_template_path": "examples/swe_smith/job-template-openai.yaml",
        },
    },
}


EXAMPLES: dict[str, dict[str, Any]] = {
    "calc_x": CALC_X,
    "gsm8k": GSM8K,
    "llm-in-sandbox": LLM_IN_SANDBOX,
    "science_world": SCIENCE_WORLD,
    "search_r1": SEARCH_R1,
    "swe_smith": SWE_SMITH,
}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`OmegaConf.merge(base, override)` on plain dicts: mappings merge key by key, anything
    else (lists included) is replaced."""
    out = copy.deepcopy(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def agl_config(name: str) -> dict[str, Any]:
    """The config Agent Lightning runs example `name` with: base ← example."""
    return merge(BASE, EXAMPLES[name])


# The dotted keys `scaled_down` may set or remove; everything else stays as Agent Lightning wrote it.
SCALED_KEYS = frozenset(
    {
        "actor_rollout_ref.model.path",
        "data.train_files",
        "data.val_files",
        "data.train_batch_size",
        "data.max_prompt_length",
        "data.max_response_length",
        "actor_rollout_ref.actor.ppo_mini_batch_size",  # in proportion: the same optimizer steps per update
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "actor_rollout_ref.rollout.max_model_len",
        "actor_rollout_ref.rollout.enforce_eager",  # CPU: no graph compilation, a start in seconds
        "actor_rollout_ref.rollout.engine_kwargs.vllm.chat_template",  # a file of the example's folder
        "actor_rollout_ref.rollout.engine_kwargs.vllm.moe_backend",  # a GPU MoE kernel
        "trainer.n_gpus_per_node",
        "trainer.nnodes",
        "trainer.logger",
        "trainer.default_local_dir",
        "trainer.total_training_steps",
        "agentlightning.agl_base_url",
        "agentlightning.agl_key",
        "agentlightning.local.agent_class",
        "agentlightning.local.env_map",
        "agentlightning.k8s.job_template_path",
        "agentlightning.async_rollout.async_train_batch_size",  # in proportion to the batch
        "agentlightning.trace_aggregator.trajectory_max_prompt_length",
        "agentlightning.trace_aggregator.trajectory_max_response_length",
    }
)


def scaled_down(
    name: str,
    *,
    model_dir: str | Path,
    train_file: str | Path,
    agent_class: str,
    env_map: dict[str, str],
    runs_dir: str | Path,
    agl_base_url: str,
    val_file: str | Path | None = None,
    agl_key: str | None = None,
    steps: int = 2,
    train_batch_size: int = 2,
    max_prompt_length: int = 256,
    max_response_length: int = 128,
    max_model_len: int = 512,
) -> dict[str, Any]:
    """Example `name`'s config (base ← example) for `steps` updates on this CPU machine: one
    rank and one engine, the given model, tasks (JSONL) and agent (`env_map` from its task
    inputs), run folders under `runs_dir`, the gateway at `agl_base_url`, small batches and
    token budgets. Only `SCALED_KEYS` change; `agl_key` None keeps Agent Lightning's. Write it
    with `write_config` for `rollover train` (or `tests.runs.train_briefly`)."""
    config = agl_config(name)
    data, trainer, agl = config["data"], config["trainer"], config["agentlightning"]
    rollout, actor = config["actor_rollout_ref"]["rollout"], config["actor_rollout_ref"]["actor"]
    config["actor_rollout_ref"]["model"]["path"] = str(model_dir)

    batch = data["train_batch_size"]
    data.update(
        train_files=str(train_file),
        train_batch_size=train_batch_size,
        max_prompt_length=max_prompt_length,
        max_response_length=max_response_length,
    )
    if val_file is not None:
        data["val_files"] = str(val_file)
    if "ppo_mini_batch_size" in actor:
        mini = actor["ppo_mini_batch_size"] * train_batch_size / batch
        if mini < 1 or mini != int(mini):
            raise ValueError(f"{name}: train_batch_size={train_batch_size} cannot keep its mini-batch proportion")
        actor["ppo_mini_batch_size"] = int(mini)
    window = agl["async_rollout"]["async_train_batch_size"]
    if window is not None:
        agl["async_rollout"]["async_train_batch_size"] = max(
            train_batch_size + 1, math.ceil(window * train_batch_size / batch)
        )

    rollout["tensor_model_parallel_size"] = 1
    rollout["max_model_len"] = max_model_len
    if rollout.get("enforce_eager") is False:
        rollout["enforce_eager"] = True
    engine_kwargs = rollout.get("engine_kwargs", {}).get("vllm", {})
    for key in ("chat_template", "moe_backend"):
        engine_kwargs.pop(key, None)

    trainer.update(
        n_gpus_per_node=1,
        nnodes=1,
        logger=["jsonl"],
        default_local_dir=str(runs_dir),
        total_training_steps=steps,
    )

    agl["agl_base_url"] = agl_base_url
    if agl_key is not None:
        agl["agl_key"] = agl_key
    agl["local"] = {"agent_class": agent_class, "env_map": dict(env_map)}
    agl["k8s"] = {"job_template_path": None}
    agl["trace_aggregator"].update(
        trajectory_max_prompt_length=max_prompt_length, trajectory_max_response_length=max_response_length
    )
    return config


def write_config(config: dict[str, Any], path: str | Path) -> Path:
    """`config` as the YAML file a user passes to `rollover train`."""
    out = Path(path)
    out.write_text(yaml.safe_dump(config, sort_keys=False))
    return out
