"""A transformers causal LM, wrapped the usual way (no ``forward``: ``training_step`` returns
``self.model(input_ids=x, labels=x).loss``), monitored at the monitors' defaults.  GPT-2
has LayerNorms; Llama RMSNorms; Gemma RMSNorms whose gain is ``1 + weight``: lnmonitor
finds each from its output, with no configuration.  Random weights from a small config.

    python examples/transformers_causal_lm.py --family gemma --steps 300
"""

from __future__ import annotations

import argparse

import lightning as L
import torch
import transformers
from lightning.pytorch.loggers import TensorBoardLogger
from text_windows import VOCAB, loaders

from lnmonitor import FinalNormInvarianceMonitor, LayerNormMonitor

LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=128, n_layer=4, n_head=4,
                                            n_positions=128),
    "llama": lambda: transformers.LlamaConfig(**LLAMA_LIKE),
    "gemma": lambda: transformers.GemmaConfig(**LLAMA_LIKE, head_dim=32),
}


class CausalLM(L.LightningModule):
    def __init__(self, family: str) -> None:
        super().__init__()
        self.model = transformers.AutoModelForCausalLM.from_config(CONFIGS[family]())

    def training_step(self, batch, batch_idx):
        x, _ = batch
        loss = self.model(input_ids=x, labels=x).loss
        self.log("train/loss", loss, prog_bar=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, _ = batch
        self.log("val/loss", self.model(input_ids=x, labels=x).loss)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def build(family: str, context: int = 64, batch_size: int = 16):
    """``(module, train, val)`` of this example (the overhead benchmark reuses it)."""
    torch.manual_seed(0)
    return CausalLM(family), *loaders(context, batch_size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", choices=sorted(CONFIGS), default="gpt2")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--out", default="runs/examples")
    args = parser.parse_args()
    module, train, val = build(args.family)
    trainer = L.Trainer(
        max_steps=args.steps, logger=TensorBoardLogger(args.out, name=f"transformers-{args.family}"),
        callbacks=[LayerNormMonitor(), FinalNormInvarianceMonitor()],
        log_every_n_steps=min(50, args.steps), val_check_interval=min(100, args.steps),
        check_val_every_n_epoch=None, limit_val_batches=4, enable_checkpointing=False,
    )
    trainer.fit(module, train, val)
    print(f"logs: {trainer.logger.log_dir}\nopen with: tensorboard --logdir {args.out}")


if __name__ == "__main__":
    main()
