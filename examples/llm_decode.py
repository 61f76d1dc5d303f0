"""Greedy decoding of a small Llama (built from a config, random weights: nothing is downloaded)
with a static KV cache, the prefill and the decode step each wrapped by graphtrees.

    python examples/llm_decode.py              # CUDA if available, else the CPU emulation
    python examples/llm_decode.py --device cpu --tokens 32

The tokens are checked against transformers' own generate(); the tree is printed at the end.
"""

import argparse
import inspect

import torch
import transformers

import graphtrees


def tiny_llama(device):
    """The example's model: a 2-layer Llama from a config, random weights (seeded)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return cfg, transformers.LlamaForCausalLM(cfg).to(device).eval()


def cache_argument(model):
    """transformers >= 5.24 calls the cache argument `cache`; earlier releases past_key_values."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokens", type=int, default=32)
    args = parser.parse_args()
    cfg, model = tiny_llama(args.device)
    prompt = torch.randint(0, cfg.vocab_size, (1, 12), device=args.device)
    with torch.no_grad():
        reference = model.generate(
            prompt, max_new_tokens=args.tokens, do_sample=False, cache_implementation="static"
        )
        cache = transformers.StaticCache(config=cfg, max_cache_len=prompt.shape[1] + args.tokens)
        cache_arg = cache_argument(model)

        def step(ids, position):
            out = model(
                input_ids=ids, cache_position=position, use_cache=True, **{cache_arg: cache}
            )
            return out.logits[:, -1]

        prefill = graphtrees.cudagraphify(step, name="prefill")
        decode = graphtrees.cudagraphify(step, name="decode")
        for _ in range(2):  # the second generation replays what the first recorded
            cache.reset()
            tokens = prompt
            logits = prefill(prompt, torch.arange(prompt.shape[1], device=args.device))
            for i in range(args.tokens):
                next_token = logits.argmax(-1, keepdim=True)
                tokens = torch.cat([tokens, next_token], dim=1)
                if i + 1 < args.tokens:
                    position = torch.tensor([tokens.shape[1] - 1], device=args.device)
                    logits = decode(next_token, position)
    assert torch.equal(tokens, reference), "graphtrees' tokens differ from generate()"
    info = graphtrees.tree_info(args.device)
    print(
        f"{args.tokens} tokens equal to generate(); backend {info['backend']}, "
        f"{info['num_replays']} replays, {info['num_nodes']} nodes"
    )
    print(graphtrees.tree_to_dot(args.device))


if __name__ == "__main__":
    main()
