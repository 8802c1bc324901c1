"""transformers' Trainer driving a tiermem training on the CPU over the fake backend, as
examples/hf_trainer.py does on a GPU (NOTE [a loop's optimizer] in tiermem/training/loopopt.py): a
tiny Llama, a few Trainer steps with accumulation, clipping and the Trainer's learning-rate
schedule, and the plain Trainer run's logged losses, gradient norms and parameters, bitwise; also
with the streamed blocks stepped on the host (NOTE [host stepping])."""
from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from fakes import FakeBackend

import tiermem

transformers = pytest.importorskip("transformers")

_HERE = os.path.dirname(os.path.abspath(__file__))


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_example",
                                                  os.path.join(_HERE, "..", "examples", "hf_trainer.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model():
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=256, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _args(tmp_path, bf16):
    return transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                          gradient_accumulation_steps=2, max_steps=4, learning_rate=1e-3,
                                          warmup_steps=1, max_grad_norm=0.5, logging_steps=1, save_strategy="no",
                                          report_to="none", use_cpu=True, seed=0, bf16=bf16,
                                          dataloader_num_workers=0)


def _data():
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": ids, "labels": ids} for ids in torch.randint(0, 256, (24, 32), generator=g)]


def _logged(trainer, key):
    return [h[key] for h in trainer.state.log_history if key in h]


@pytest.mark.parametrize("bf16, host", [(False, False), (True, False), (True, True)],
                         ids=["fp32", "bf16-autocast", "bf16-autocast-host-step"])
def test_the_trainer_drives_a_tiered_training_as_it_drives_a_plain_one(tmp_path, bf16, host):
    ex = _example()
    data = _data()
    model = _model()
    args = _args(tmp_path / "plain", bf16)
    plain = transformers.Trainer(model=model, args=args, train_dataset=data,
                                 optimizers=(ex.trainer_optimizer(model, args), None))
    plain.train()
    want, want_norms = _logged(plain, "loss"), _logged(plain, "grad_norm")
    want_params = [p.detach().clone() for p in model.parameters()]

    model = _model()
    args = _args(tmp_path / "tiered", bf16)
    tier = tiermem.Tier(backend=FakeBackend(total=1 << 30, foreign_host=True))
    budget = sum(p.numel() * p.element_size() for p in model.parameters())     # a quarter of the state
    train = ex.wrap_for_trainer(model, args, budget, tier=tier, block_bytes=16 << 10, min_swap=4096, host_step=host)
    trainer = ex.TieredTrainer(train, model=model, args=args, train_dataset=data)
    trainer.train()
    assert _logged(trainer, "loss") == want and len(want) == 4
    assert _logged(trainer, "grad_norm") == want_norms
    assert train.updates == 4 and train.steps == 8 and train.plan.streamed_blocks
    assert not host or train.host.blocks_stepped > 0     # NOTE [host stepping]: a fused CPU AdamW, bitwise
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), want_params))
    with pytest.raises(tiermem.TierMemError, match="inside"):
        with train.step():
            trainer.optimizer.step()           # the loop's step belongs after train.step()
    train.unwrap()
    assert all(torch.equal(p.detach(), q) for p, q in zip(model.parameters(), want_params))


def test_the_stepped_optimizer_is_the_wrapped_one_but_for_its_step():
    from test_train import tiered
    _, _, model, opt, train = tiered()
    so = train.stepped_optimizer()
    assert isinstance(so, torch.optim.Optimizer)
    assert so.param_groups is opt.param_groups and so.state is opt.state
    opt.load_state_dict(opt.state_dict())          # new group dicts (accelerate's prepare does this)
    assert so.param_groups is opt.param_groups
    sched = torch.optim.lr_scheduler.LambdaLR(so, lambda i: 0.5)
    assert opt.param_groups[0]["lr"] == pytest.approx(0.5e-3)       # the schedule sets the wrapped rates
    so.step()
    sched.step()
    assert so.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    with pytest.raises(tiermem.TierMemError, match="closure"):
        so.step(lambda: 0.0)
    with pytest.raises(tiermem.TierMemError, match="add the group before wrapping"):
        so.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2))]})
    train.unwrap()
