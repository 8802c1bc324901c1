"""Move an existing model into tiered memory one layer at a time, then the rest of it.

    PYTHONPATH=. python examples/adopt_layer_by_layer.py     (needs a GPU and transformers)
"""
import torch
import transformers

import tiermem as tier

cfg = transformers.LlamaConfig(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
                               vocab_size=32000)
with torch.device("cuda"):
    model = transformers.LlamaForCausalLM(cfg).half().eval().requires_grad_(False)
ids = torch.randint(0, cfg.vocab_size, (1, 128), device="cuda")
with torch.no_grad():
    want = model(ids).logits

    # one decoder layer first: its weights go to managed memory, the rest stays as it was
    first = tier.wrap_module(model.model.layers[0])
    assert torch.equal(model(ids).logits, want)
    first.unwrap()

    # then the whole model, within a quarter of its weights
    handle = tier.wrap_module(model, budget=tier.planning.weight_bytes(model) // 4)
    print(handle.plan)
    model(ids)                                  # learns the execution order
    assert torch.equal(model(ids).logits, want)
    print(tier.memory_summary())
    handle.unwrap()
