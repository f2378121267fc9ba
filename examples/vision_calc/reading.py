"""Does a (warmed-up) vision calc policy read its pictures? Plays the task on held-out pictures
with plain transformers `generate` (no engine): the share of first calls that copy the
expression exactly, the share of characters copied right, and the reward, greedy and at T=1.

  python -m examples.vision_calc.reading MODEL_DIR [--tasks 40] [--samples 2]
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from examples.calc.task import CALL as CALL_RE
from examples.vision_calc.task import SYSTEM_PROMPT, calculate, make_tasks, score, user_message


class Policy:
    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        from rollover.vision.inputs import load_image_processor
        from rollover.vision.model import auto_model_class

        self.tokenizer = AutoTokenizer.from_pretrained(path)
        self.model = auto_model_class(path).from_pretrained(path).eval()
        self.processor = load_image_processor(path)
        self.image_id = int(self.model.config.image_token_id)

    def reply(self, messages: list[dict[str, Any]], temperature: float, max_tokens: int = 24) -> str:
        import torch

        from rollover.modelzoo.vl_warmup import chat_images
        from rollover.vision.inputs import expand_placeholders, pixel_inputs

        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        pixels = pixel_inputs(self.processor, chat_images(messages))
        ids = expand_placeholders(ids, self.image_id, pixels.tokens)
        input_ids = torch.tensor([ids])
        sampling: dict[str, Any] = {"do_sample": False}
        if temperature > 0:
            sampling = {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
        with torch.no_grad():
            out = self.model.generate(
                input_ids=input_ids,
                attention_mask=torch.ones_like(input_ids),
                mm_token_type_ids=(input_ids == self.image_id).int(),
                pixel_values=pixels.pixel_values,
                image_grid_thw=pixels.image_grid_thw,
                max_new_tokens=max_tokens,
                **sampling,
            )
        return str(self.tokenizer.decode(out[0, len(ids) :], skip_special_tokens=True))

    def episode(self, task: dict[str, Any], temperature: float, max_turns: int = 3) -> tuple[str | None, float]:
        """The agent's loop (agent.py): the expression of its first call, and its reward."""
        messages = [{"role": "system", "content": SYSTEM_PROMPT}, user_message(task["expression"])]
        copied, final = None, ""
        for _ in range(max_turns):
            text = self.reply(messages, temperature)
            messages.append({"role": "assistant", "content": text})
            if "ANSWER:" in text:
                final = text
                break
            call = CALL_RE.search(text)
            if call is None:
                break
            copied = call.group(1) if copied is None else copied
            try:
                result = str(calculate(call.group(1)))
            except (ValueError, SyntaxError, RecursionError):
                result = "error"
            messages.append({"role": "tool", "content": result})
        return copied, score(task, final)


def reading(path: str, tasks: int = 40, samples: int = 2, seed: int = 0) -> dict[str, Any]:
    """Held-out (the validation tasks' pictures, as the agent draws them): greedy once, T=1
    `samples` times per task."""
    import torch

    torch.manual_seed(seed)
    policy = Policy(path)
    held_out = make_tasks(tasks, seed=2, start=2000)
    report: dict[str, Any] = {}
    for name, temperature, repeats in (("greedy", 0.0, 1), ("t1", 1.0, samples)):
        copies = rewards = right = chars = 0.0
        for task in held_out:
            for _ in range(repeats):
                copied, reward = policy.episode(task, temperature)
                expression = task["expression"]
                copies += copied == expression
                rewards += reward
                right += sum(a == b for a, b in zip(expression, copied or ""))
                chars += len(expression)
        runs = len(held_out) * repeats
        report[name] = {"copy": copies / runs, "chars": right / chars, "reward": rewards / runs, "episodes": runs}
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model")
    parser.add_argument("--tasks", type=int, default=40)
    parser.add_argument("--samples", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    print(json.dumps(reading(args.model, args.tasks, args.samples), indent=2))


if __name__ == "__main__":
    main()
