"""A language model's head and cross-entropy over token chunks (NOTE [chunked loss]).

NOTE [chunked loss]
    A causal LM's loss holds, at its peak, several tensors of [tokens, vocab]: the head's logits
    in the compute dtype, their fp32 copy (transformers' loss upcasts), cross-entropy's
    log-probabilities, and in backward their gradient and the logits' (a 1.1B Llama with a
    32000 vocabulary at 4x2048 tokens: 0.5 to 1 GB each, 3 GB or more at once). Where that sets
    the floor of a tiered training (NOTE [the floor]), no plan of tiermem's can lower it: those
    are live inside one autograd node each. :func:`chunked_lm_loss` computes the head and the
    loss over ``chunk_tokens`` tokens at a time and keeps none of the logits: backward computes
    each chunk's logits again from the saved hidden states and the head's weight, the way
    activation checkpointing does, so the peak is a few chunks' logits, whatever the batch.
    What a chunk's recomputation saves is used at once, by that chunk's gradient, so it is
    saved as it is, past any saved-tensor hooks outside: a tiered training's swap (NOTE
    [activation swap]) would copy each chunk's bf16 head weight and log-probabilities out and
    back in: for the model above, 16 chunks of 131 MB and 67 MB, about 3 GB each way a step.
    The head's weight gradient is summed over the chunks in one buffer of the weight's dtype and
    handed to autograd once, so it accumulates once: a tiered training steps the head's block
    when its gradients are complete, and a gradient in pieces would step it after the first.

    The numbers are the plain head's and loss's, summed in another order (per chunk, then the
    chunks): not bitwise those of ``model(labels=...)``, bitwise themselves from run to run, so a
    plain loop and a tiered training that both use it give the same losses bitwise. The loss is
    transformers' (``ForCausalLMLoss``): with ``shift`` the logits at position t predict the
    label at t + 1, labels of ``ignore_index`` count for nothing, and the mean is over the
    tokens that count. Autocast as the forward ran is restored for the recomputation. The
    head's forward runs as a module call, chunk by chunk, so a tiered training brings its block
    in as for any forward; in backward its weight, saved, brings the block back with its states.
"""
from __future__ import annotations

from typing import Any

from ..errors import ConfigError, ConfigTypeError

__all__ = ["CHUNK_BYTES", "chunk_tokens_for", "chunked_lm_loss"]

CHUNK_BYTES = 64 << 20     # fp32 logits of one chunk, by default (NOTE [chunked loss])

_FN: list[Any] = []        # the autograd Function, made at first use (torch is imported then)


def chunk_tokens_for(vocab: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Tokens per chunk whose fp32 logits over ``vocab`` take about ``chunk_bytes``."""
    return max(1, int(chunk_bytes) // (4 * max(int(vocab), 1)))


def chunked_lm_loss(head: Any, hidden: Any, labels: Any, *, chunk_tokens: int | None = None, shift: bool = True,
                    ignore_index: int = -100) -> Any:
    """The mean cross-entropy of ``head(hidden)`` against ``labels``, computed ``chunk_tokens``
    tokens at a time without keeping the logits (NOTE [chunked loss]).

    ``head``: the model's output projection, a ``torch.nn.Linear`` (``model.lm_head``);
    ``hidden``: the last hidden states, ``[..., tokens, hidden]`` (``model.model(...)``'s
    ``last_hidden_state``); ``labels``: ``[..., tokens]`` token ids, as ``model(labels=...)``
    takes them (shifted here with ``shift``). ``chunk_tokens``: tokens a chunk (default: about
    64 MiB of fp32 logits)."""
    import torch
    if not isinstance(head, torch.nn.Linear):
        raise ConfigTypeError(f"chunked_lm_loss takes the model's head as a torch.nn.Linear, got {type(head).__name__}")
    if not torch.is_tensor(hidden) or not torch.is_tensor(labels):
        raise ConfigTypeError(f"chunked_lm_loss takes tensors, got hidden {type(hidden).__name__} and labels "
                              f"{type(labels).__name__}")
    if hidden.shape[:-1] != labels.shape or hidden.shape[-1] != head.in_features:
        raise ConfigError(f"hidden states {tuple(hidden.shape)} and labels {tuple(labels.shape)} do not match: "
                          f"hidden is [..., tokens, {head.in_features}] and labels [..., tokens]")
    if chunk_tokens is None:
        chunk_tokens = chunk_tokens_for(head.out_features)
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ConfigError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if shift:
        # transformers' ForCausalLMLoss: labels padded with ignore_index, then shifted left
        labels = torch.nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    h = hidden.reshape(-1, hidden.shape[-1])
    y = labels.reshape(-1).to(h.device)
    if not _FN:
        _FN.append(_make_function(torch))
    params = (head.weight,) if head.bias is None else (head.weight, head.bias)
    return _FN[0].apply(head, int(chunk_tokens), int(ignore_index), h, y, *params)


def _same(t: Any) -> Any:
    return t


def _make_function(torch: Any) -> Any:
    F = torch.nn.functional

    def chunk_loss(logits: Any, y: Any, ignore_index: int) -> Any:
        return F.cross_entropy(logits.float(), y, ignore_index=ignore_index, reduction="sum")

    class ChunkedLMLoss(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, head: Any, chunk: int, ignore_index: int, h: Any, y: Any, *params: Any) -> Any:
            dev = h.device.type
            ctx.autocast = (torch.is_autocast_enabled(dev), torch.get_autocast_dtype(dev), dev)
            ctx.chunk, ctx.ignore_index = chunk, ignore_index
            total = torch.zeros((), dtype=torch.float32, device=h.device)
            for a in range(0, h.shape[0], chunk):
                total += chunk_loss(head(h[a:a + chunk]), y[a:a + chunk], ignore_index)
            count = (y != ignore_index).sum()
            ctx.save_for_backward(h, y, count, *params)
            # every label ignored: 0/0, NaN, as torch's mean cross-entropy gives
            return total / count

        @staticmethod
        def backward(ctx: Any, grad: Any) -> Any:
            h, y, count, *params = ctx.saved_tensors
            on, dtype, dev = ctx.autocast
            chunk, ignore_index = ctx.chunk, ctx.ignore_index
            need_h = ctx.needs_input_grad[3]
            need_p = [ctx.needs_input_grad[5 + i] for i in range(len(params))]
            scale = grad / count
            gh = torch.empty_like(h) if need_h else None
            gp = [torch.zeros_like(p) if n else None for p, n in zip(params, need_p)]
            # NOTE [chunked loss]: the head cast once, as autocast casts it, and each chunk's grad
            # taken at that dtype and added into the fp32 sum: the same values as through autocast's
            # cast, without a chunk's grad at the weight's full size (a 32k vocabulary's fp32 head
            # grad is 262 MB, asked anew each chunk)
            w = [(p.detach().to(dtype) if on and p.dtype == torch.float32 else p.detach()).requires_grad_(n)
                 for p, n in zip(params, need_p)]
            for a in range(0, h.shape[0], chunk):
                hc = h[a:a + chunk].detach().requires_grad_(need_h)
                # what this chunk's recomputation saves is read by the grad just below, never by
                # the step's backward: the identity hooks keep it where it is, past any outer
                # hooks (a tiered training's swap would copy it out and back, NOTE [chunked loss])
                with torch.enable_grad(), torch.autocast(dev, dtype=dtype, enabled=on), \
                        torch.autograd.graph.saved_tensors_hooks(_same, _same):
                    loss = chunk_loss(F.linear(hc, *w), y[a:a + chunk], ignore_index)
                wrt = ([hc] if need_h else []) + [x for x, n in zip(w, need_p) if n]
                if not wrt:
                    continue
                got = list(torch.autograd.grad(loss, wrt, scale))
                if need_h:
                    gh[a:a + chunk] = got.pop(0)
                for i, n in enumerate(need_p):
                    if n:
                        gp[i].add_(got.pop(0))
            return (None, None, None, gh, None, *gp)

    return ChunkedLMLoss
