"""A transformers causal LM trained by ``transformers.Trainer`` -- no Lightning -- monitored
by ``LNMonitorCallback``: the ladder and shares every ``logging_steps`` steps, the
final-norm invariance on held-out rows with the model's own ``labels`` loss, reported to
TensorBoard (``report_to``; its tags start with ``train/``).  Random weights from a small
config, the Python help text as bytes.

    python examples/transformers_trainer.py --family llama --steps 300
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import transformers
from text_windows import VOCAB, loaders

from lnmonitor.integrations.transformers import LNMonitorCallback

LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=4, n_head=4,
                                            n_positions=128),
    "llama": lambda: transformers.LlamaConfig(**LLAMA_LIKE),
}


def as_records(loader) -> list[dict]:
    """The windows as the Trainer's records: ``input_ids`` and the same ids as ``labels``."""
    return [{"input_ids": x, "labels": x} for x, _ in loader.dataset]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(CONFIGS), default="gpt2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/examples")
    args = parser.parse_args()
    transformers.set_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[args.family]())
    train, val = loaders(context=64, batch_size=16)
    logs = Path(args.out) / f"trainer-{args.family}"
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(logs)  # where the Trainer's TensorBoard writes
    training = transformers.TrainingArguments(
        output_dir=str(logs / "checkpoints"), max_steps=args.steps, per_device_train_batch_size=16,
        gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=min(50, args.steps),
        save_strategy="no", report_to=["tensorboard"], use_cpu=True, disable_tqdm=True,
    )
    trainer = transformers.Trainer(model=model, args=training, train_dataset=as_records(train),
                                   eval_dataset=as_records(val))
    trainer.add_callback(LNMonitorCallback(trainer, invariance_every_n_steps=min(1000, args.steps)))
    trainer.train()
    print(f"logs: {logs}\nopen with: tensorboard --logdir {args.out}")


if __name__ == "__main__":
    main()
