"""A PaddleFormers training script: a tiny Llama (random init) on synthetic tokens.

``python train_pf_stock.py --ckpt-dir D --log-dir L --steps N``: the stock script; train_pf_tide.py is the same
script under Tide; docs/migrate.md shows the diff (tests/trainer/test_migrate_docs.py).
"""

import argparse

import numpy as np
import paddle
from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

from tide.trainer.integrations.paddleformers import Trainer, TrainingArguments


class Tokens(paddle.io.Dataset[dict[str, np.ndarray]]):
    def __init__(self, size: int, length: int, vocab: int) -> None:
        rng = np.random.default_rng(0)
        self.tokens = rng.integers(0, vocab, (size, length + 1)).astype(np.int64)

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}

    def __len__(self) -> int:
        return len(self.tokens)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ckpt-dir", default="out")
    p.add_argument("--log-dir", default="")
    p.add_argument("--steps", type=int, default=20)
    cli = p.parse_args()
    paddle.seed(0)
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
        fuse_rms_norm=False,  # the fused kernel is GPU-only
    )
    args = TrainingArguments(
        output_dir=cli.ckpt_dir,
        logging_dir=cli.log_dir or None,
        max_steps=cli.steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        warmup_steps=2,
        max_grad_norm=0.0,
        amp_master_grad=False,
        save_steps=5,
        seed=0,
        report_to=[],
    )
    trainer = Trainer(model=LlamaForCausalLM(config), args=args, train_dataset=Tokens(256, 16, 64))
    trainer.train()
    trainer.save_model()


if __name__ == "__main__":
    main()
