"""A transformers causal LM built from a config (random weights, nothing downloaded): wrapped
whole (its ModelOutput comes back), and decoding with a static cache, prefill and decode step
wrapped, tokens equal to eager generate()."""

import pytest
import torch

import graphtrees

from helpers import info

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("no_grad")


def tiny_llama(device):
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
    )
    return transformers.LlamaForCausalLM(cfg).to(device).eval()


def test_model_wrapped_whole_returns_its_model_output(device):
    model = tiny_llama(device)
    g = graphtrees.cudagraphify(model)
    for _ in range(4):
        ids = torch.randint(0, 128, (2, 16), device=device)
        out = g(input_ids=ids, use_cache=False)
        assert type(out).__name__ == "CausalLMOutputWithPast"
        torch.testing.assert_close(out.logits, model(input_ids=ids, use_cache=False).logits)
    assert [s["eager_reason"] for s in g.signatures()] == [None]
    assert info(device)["num_replays"] == 2


def test_static_cache_decoding_matches_generate(device):
    model = tiny_llama(device)
    prompt = torch.randint(0, 128, (1, 8), device=device)
    new_tokens = 32
    ref = model.generate(
        prompt, max_new_tokens=new_tokens, do_sample=False, cache_implementation="static"
    )
    cache = transformers.StaticCache(
        config=model.config, max_cache_len=prompt.shape[1] + new_tokens
    )

    import inspect

    # transformers >= 5.24 calls the cache argument `cache`; earlier releases `past_key_values`.
    cache_arg = (
        "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    )

    def step(ids, position):
        return model(
            input_ids=ids, cache_position=position, use_cache=True, **{cache_arg: cache}
        ).logits[:, -1]

    prefill = graphtrees.cudagraphify(step, name="prefill")
    decode = graphtrees.cudagraphify(step, name="decode")
    for attempt in range(2):  # the second pass replays the recorded prefill and decode step
        cache.reset()
        tokens = prompt
        logits = prefill(prompt, torch.arange(prompt.shape[1], device=device))
        for i in range(new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            if i == new_tokens - 1:
                break
            logits = decode(nxt, torch.tensor([tokens.shape[1] - 1], device=device))
        assert torch.equal(tokens, ref), (attempt, tokens, ref)
    assert info(device)["num_replays"] > new_tokens
