"""A transformers causal LM fine-tuned by ``transformers.Trainer`` -- no Lightning -- as a
fine-tuning script is written: lines of text of different lengths, a tokenizer, the standard
LM collator (``DataCollatorForLanguageModeling(mlm=False)``: dynamic padding, labels -100 on
the padding), the Trainer's default arguments, and ``trainer.add_callback(LNMonitorCallback(trainer))``.
The ladder and shares land on the Trainer's logging steps beside its loss, the final-norm
invariance on held-out rows (the eval set's first 64, joined across padded lengths) with the
model's own ``labels`` loss, all in TensorBoard (``report_to``; its tags start with
``train/``, and a Custom Scalars layout draws them).  Random weights from a small config; the
text is the Python help text and the tokenizer a character-level WordLevel built here, so
nothing is downloaded.

    python examples/transformers_trainer.py --family llama --steps 300
    lnmonitor summarize runs/examples/trainer-llama
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import tokenizers
import transformers

from lnmonitor.integrations.transformers import LNMonitorCallback
from lnmonitor.tiny.corpus import load_corpus

CONFIGS = {
    "gpt2": lambda vocab, pad: transformers.GPT2Config(vocab_size=vocab, n_embd=128, n_layer=4, n_head=4,
                                                       n_positions=128, pad_token_id=pad),
    "llama": lambda vocab, pad: transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, pad_token_id=pad),
}


def char_tokenizer(text: str) -> transformers.PreTrainedTokenizerFast:
    """One token per character of ``text`` (WordLevel over single characters), with a pad token."""
    vocab = {"[PAD]": 0, "[UNK]": 1, **{c: i + 2 for i, c in enumerate(sorted(set(text)))}}
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Split(tokenizers.Regex("."), behavior="isolated")
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(CONFIGS), default="gpt2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/examples")
    args = parser.parse_args()
    transformers.set_seed(0)
    text = load_corpus()
    tokenizer = char_tokenizer(text)
    lines = [line[:120] for line in text.splitlines() if len(line.strip()) > 8]  # 9 to 120 characters
    cut = int(0.9 * len(lines))
    train = [tokenizer(line) for line in lines[:cut]]
    val = [tokenizer(line) for line in lines[cut:]]
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[args.family](len(tokenizer),
                                                                               tokenizer.pad_token_id))
    logs = Path(args.out) / f"trainer-{args.family}"
    os.environ["TENSORBOARD_LOGGING_DIR"] = str(logs)  # where the Trainer's TensorBoard writes
    training = transformers.TrainingArguments(
        output_dir=str(logs / "checkpoints"), max_steps=args.steps, per_device_train_batch_size=16,
        gradient_accumulation_steps=2, learning_rate=1e-3, logging_steps=min(50, args.steps),
        save_strategy="no", report_to=["tensorboard"], use_cpu=True, disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=training, train_dataset=train, eval_dataset=val, processing_class=tokenizer,
        data_collator=transformers.DataCollatorForLanguageModeling(tokenizer, mlm=False),
    )
    trainer.add_callback(LNMonitorCallback(trainer, invariance_every_n_steps=min(1000, args.steps)))
    trainer.train()
    print(f"logs: {logs}\nopen with: tensorboard --logdir {args.out}\nor: lnmonitor summarize {logs}")


if __name__ == "__main__":
    main()
