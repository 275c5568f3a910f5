"""transformers' Trainer as its users write it, on a tiny BERT built from a config (no
download): TrainingArguments, a dataset, Trainer.train(). Run as a script (the watcher,
torchrun) or call train() in ranks (launch). OUTPUT_DIR names where the Trainer writes."""
import os
import sys

import torch
from transformers import (BertConfig, BertForSequenceClassification, Trainer,
                          TrainingArguments)


class Tiny(torch.utils.data.Dataset):
    def __len__(self):
        return 32

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 50, (8,), generator=g),
                "labels": torch.tensor(i % 2)}


def train(output_dir, progress=False):
    torch.manual_seed(0)
    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32)
    model = BertForSequenceClassification(config)
    args = TrainingArguments(output_dir=output_dir, per_device_train_batch_size=4,
                             max_steps=4, use_cpu=True, report_to=[], save_strategy="no",
                             logging_strategy="no", disable_tqdm=not progress,
                             ddp_backend="gloo")
    trainer = Trainer(model=model, args=args, train_dataset=Tiny())
    out = trainer.train()
    return {"rank": args.process_index, "world": args.world_size,
            "steps": out.global_step, "parallel": str(args.parallel_mode)}


if __name__ == "__main__":
    summary = train(sys.argv[1], progress=True)
    print("HF done", summary, flush=True)
