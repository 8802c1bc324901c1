"""Fine-tune with transformers' Trainer within a device budget: the Trainer's loop, tiermem's steps.

    PYTHONPATH=. python examples/hf_trainer.py      (needs a GPU and transformers; a tiny random Llama)

The three lines that adopt tiermem are marked. The Trainer calls ``optimizer.step()`` after each
window of micro-batches; tiermem steps the optimizer itself, each block inside backward, so the
Trainer gets ``train.stepped_optimizer()``, whose ``step()`` does nothing and whose groups are the
wrapped optimizer's (the Trainer's learning-rate schedule sets the rates tiermem steps with).
``TieredTrainer`` runs each of the Trainer's micro-batches inside ``train.step()``; clipping and
accumulation are tiermem's options, given the Trainer's own settings.
"""
from __future__ import annotations

import tempfile

import torch
import transformers

import tiermem


class TieredTrainer(transformers.Trainer):
    """A Trainer whose micro-batches run inside ``train.step()`` of a tiermem training."""

    def __init__(self, train, *args, **kwargs):
        self.tiered = train
        kwargs["optimizers"] = (train.stepped_optimizer(), kwargs.get("optimizers", (None, None))[1])
        super().__init__(*args, **kwargs)

    def training_step(self, model, inputs, num_items_in_batch=None):
        # the Trainer says whether this micro-batch ends its window (its optimizer.step() follows)
        with self.tiered.step(update=self.accelerator.sync_gradients):
            return super().training_step(model, inputs, num_items_in_batch)

    def log(self, logs, *args, **kwargs):
        # the Trainer's own clip sees no gradients (tiermem stepped and cleared them): report tiermem's norm
        if "grad_norm" in logs and self.tiered.grad_norm is not None:
            logs["grad_norm"] = float(self.tiered.grad_norm)
        super().log(logs, *args, **kwargs)


def trainer_optimizer(model, args):
    """The optimizer the Trainer makes by default: fused AdamW, no decay on biases and norms."""
    decay = set(transformers.Trainer.get_decay_parameter_names(None, model))
    groups = [{"params": [p for n, p in model.named_parameters() if n in decay and p.requires_grad],
               "weight_decay": args.weight_decay},
              {"params": [p for n, p in model.named_parameters() if n not in decay and p.requires_grad],
               "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                             eps=args.adam_epsilon, fused=True)


def wrap_for_trainer(model, args, budget, **options):
    """``trainer_optimizer``'s optimizer wrapped by tiermem with the Trainer's accumulation and
    clipping (``options``: more of wrap_training's, ``tier=`` among them)."""
    return tiermem.wrap_training(model, trainer_optimizer(model, args), budget,
                                 accumulate=args.gradient_accumulation_steps,
                                 max_grad_norm=args.max_grad_norm or None, **options)


def main():
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1408, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=2, vocab_size=8192,
                                   max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)            # on the host: tiermem takes it to the device
    g = torch.Generator().manual_seed(1)
    data = [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, cfg.vocab_size, (64, 256), generator=g)]
    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=4,
                                          gradient_accumulation_steps=2, max_steps=8, learning_rate=1e-4,
                                          bf16=True, logging_steps=1, save_strategy="no", report_to="none")
    state = 16 * sum(p.numel() for p in model.parameters())    # fp32 parameters, gradients, AdamW moments
    train = wrap_for_trainer(model, args, budget=state // 3, block_bytes=16 << 20)      # 1. adopt
    trainer = TieredTrainer(train, model=model, args=args, train_dataset=data)           # 2. the Trainer
    trainer.train()                                                                       # 3. as ever
    print(train.plan)
    print({k: v for k, v in train.report().items() if k in ("budget_bytes", "resident_peak_bytes", "updates")})
    print([round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h])
    train.unwrap()


if __name__ == "__main__":
    main()
