"""Generation checks of the fused decode path against the torch path, shared by the kernel and codec tests."""

import torch

from kvcomp.cache import CompressedCache, install


def generate_logits(model, codec, protocol, backend, new_tokens):
    """Logits of ``new_tokens`` greedy tokens after a left-padded batch of 2, and the cache, on ``backend``'s decode
    path."""
    ids = torch.randint(1, 96, (2, 37), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    install(model, kernel_backend=backend)
    try:
        cache = CompressedCache(codec, protocol)
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, past_key_values=cache, pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
    finally:
        install(model, kernel_backend="torch")
    return torch.stack(out.logits, dim=1), cache


def check_fused_generation(model, codec, protocol="exact_prefill", new_tokens=6):
    """Generation of ``new_tokens`` tokens on the fused kernels equals the torch path's; returns the fused cache's
    layer 1."""
    reference, _ = generate_logits(model, codec, protocol, "torch", new_tokens)
    fused, cache = generate_logits(model, codec, protocol, "triton", new_tokens)
    torch.testing.assert_close(fused, reference, rtol=1e-4, atol=1e-4)
    return cache.layers[1]


def check_graphed_generation(model, codec, monkeypatch, new_tokens=9) -> None:
    """Generation of ``new_tokens`` tokens with ``codec`` under CUDA graphs (a stand-in capture) equals the torch
    path's, and its last step replays every call by its inputs, building no launch."""
    from kvcomp.kernels import decode_attention_triton as kernels

    built = []
    setup_launches = kernels.setup_launches
    monkeypatch.setattr(kernels, "setup_launches", lambda *args, **kw: built.append(1) or setup_launches(*args, **kw))
    ids = torch.randint(1, 96, (2, 37), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :5] = 0
    logits, marks = {}, []
    for backend, graphs in (("torch", False), ("triton", True)):
        installation = install(model, kernel_backend=backend, cuda_graphs=graphs)
        if graphs:
            installation.workspace.graphs.capture = lambda run: run
        hook = model.register_forward_pre_hook(lambda *_: marks.append(len(built)))
        try:
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
                                 past_key_values=CompressedCache(codec, "streaming", capacity=64),
                                 output_logits=True, return_dict_in_generate=True)
        finally:
            hook.remove()
            install(model, kernel_backend="torch")
        logits[backend] = torch.stack(out.logits, dim=1)
    steps = [b - a for a, b in zip(marks[new_tokens:], marks[new_tokens + 1:] + [len(built)])]  # launches built per forward, fused backend
    torch.testing.assert_close(logits["triton"], logits["torch"], rtol=1e-4, atol=1e-4)
    assert installation.workspace.graphs.captured and installation.workspace.graphs.by_inputs
    assert len(steps) == new_tokens and steps[1] > 0 and steps[-1] == 0, steps  # the prompt is prefilled on the torch path
