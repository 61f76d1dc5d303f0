"""A transformers causal LM built from a config (random weights, nothing downloaded): wrapped
whole (its ModelOutput comes back), and decoding with a static cache, prefill and decode step
wrapped, tokens equal to eager generate()."""

import pytest
import torch

import graphtrees

from helpers import assert_close, assert_replays_ran_programs, info

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("no_grad")


# The size of every model here: 2 layers, d=64, 4 heads (2 key/value heads), 128 tokens.
SMALL = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


# Why an Inductor case is skipped on the CUDA stand-in (its value mode computes ATen ops only).
TRITON = "Inductor's Triton kernels compute the steps: the stand-in does not compute their values"


def tiny_llama(device):
    torch.manual_seed(0)
    # No end-of-sequence token: generate() runs to max_new_tokens, as the tests' own decode loops
    # do (with one, which tokens it stops at depends on the random prompt).
    cfg = transformers.LlamaConfig(**SMALL, eos_token_id=None)
    return transformers.LlamaForCausalLM(cfg).to(device).eval()


def test_model_wrapped_whole_returns_its_model_output(device):
    model = tiny_llama(device)
    g = graphtrees.cudagraphify(model)
    for _ in range(4):
        ids = torch.randint(0, 128, (2, 16), device=device)
        out = g(input_ids=ids, use_cache=False)
        assert type(out).__name__ == "CausalLMOutputWithPast"
        assert_close(out.logits, model(input_ids=ids, use_cache=False).logits)
    assert [s["eager_reason"] for s in g.signatures()] == [None]
    assert info(device)["num_replays"] == 2


def cache_argument(model):
    """transformers >= 5.24 calls the cache argument `cache`; earlier releases past_key_values."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def decode_with_static_cache(model, device, prompt, new_tokens, passes=2, **options):
    """examples/llm_decode.py's decode loop: a StaticCache in a closure, prefill and decode step
    wrapped (with `options`), `passes` generations; returns each generation's tokens."""
    cache = transformers.StaticCache(
        config=model.config, max_cache_len=prompt.shape[1] + new_tokens
    )
    cache_arg = cache_argument(model)

    def step(ids, position):
        return model(
            input_ids=ids, cache_position=position, use_cache=True, **{cache_arg: cache}
        ).logits[:, -1]

    prefill = graphtrees.cudagraphify(step, name="prefill", **options)
    decode = graphtrees.cudagraphify(step, name="decode", **options)
    generations = []
    for _ in range(passes):  # the second pass replays the recorded prefill and decode step
        cache.reset()
        tokens = prompt
        logits = prefill(prompt, torch.arange(prompt.shape[1], device=device))
        for i in range(new_tokens):
            nxt = logits.argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, nxt], dim=1)
            if i == new_tokens - 1:
                break
            logits = decode(nxt, torch.tensor([tokens.shape[1] - 1], device=device))
        generations.append(tokens)
    return generations


@pytest.mark.needs_values("compares logits computed by the model's kernels")
def test_model_wrapped_whole_with_its_static_cache_passed_in_is_recorded(device):
    # The output holds the StaticCache that was passed in: it is the caller's own object, and
    # every call's result holds that call's cache, so the model records and replays.
    model = tiny_llama(device)
    g = graphtrees.cudagraphify(model)
    caches = [transformers.StaticCache(config=model.config, max_cache_len=32) for _ in range(2)]
    arg = cache_argument(model)
    ids = torch.randint(0, 128, (1, 6), device=device)
    position = torch.arange(6, device=device)
    for step in range(6):
        got = g(input_ids=ids, cache_position=position, use_cache=True, **{arg: caches[0]})
        want = model(input_ids=ids, cache_position=position, use_cache=True, **{arg: caches[1]})
        assert getattr(got, arg if hasattr(got, arg) else "past_key_values") is caches[0]
        assert_close(got.logits, want.logits)
        ids = want.logits[:, -1:].argmax(-1)
        position = torch.tensor([6 + step], device=device)
    assert [s["eager_reason"] for s in g.signatures()] == [None, None]
    assert info(device)["num_replays"] >= 3


@pytest.mark.needs_values("greedy decoding feeds back token values read from the device")
def test_static_cache_decoding_matches_generate(device):
    model = tiny_llama(device)
    prompt = torch.randint(0, 128, (1, 8), device=device)
    new_tokens = 32
    ref = model.generate(
        prompt,
        max_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
        disable_compile=True,  # eager steps, as recorded: no auto-compiled reference
    )
    for attempt, tokens in enumerate(decode_with_static_cache(model, device, prompt, new_tokens)):
        assert torch.equal(tokens, ref), (attempt, tokens, ref)
    assert info(device)["num_replays"] > new_tokens
    assert_replays_ran_programs(device)


@pytest.mark.needs_values("greedy decoding feeds back token values read from the device")
@pytest.mark.parametrize("verify", [True, "warn"], ids=["raise", "warn"])
def test_verified_static_cache_decoding_updates_the_cache_once(device, verify, caplog):
    # GRAPHTREES_VERIFY=1 over that decode loop: the eager check of each replay starts
    # from the cache as the replay found it and leaves it as the replay left it (the cache's
    # position counter is advanced once), so nothing is reported and the tokens are generate()'s.
    model = tiny_llama(device)
    prompt = torch.randint(0, 128, (1, 8), device=device)
    ref = model.generate(
        prompt,
        max_new_tokens=12,
        do_sample=False,
        cache_implementation="static",
        disable_compile=True,
    )
    with caplog.at_level("WARNING", logger="graphtrees"):
        generations = decode_with_static_cache(model, device, prompt, 12, verify=verify)
    for tokens in generations:
        assert torch.equal(tokens, ref)
    assert info(device)["num_replays"] > 12
    assert "does not match" not in caplog.text


@pytest.mark.needs_kernels(TRITON)
def test_generate_with_compile_config_replays_on_its_hundredth_call(device):
    # HF's CompileConfig defaults to mode="reduce-overhead", and every generate() makes a new
    # StaticCache: the decode graph's old recording can never replay again and is replaced,
    # without counting towards rerecord_limit, so the hundredth call still replays.
    model = tiny_llama(device)
    ids = torch.randint(0, 128, (1, 6), device=device)
    want = model.generate(ids, max_new_tokens=4, do_sample=False, disable_compile=True)
    config = transformers.CompileConfig(backend="graphtrees")
    config._compile_all_devices = True  # HF compiles on accelerators only, unless asked
    replays = []
    for _ in range(100):
        got = model.generate(
            ids,
            max_new_tokens=4,
            do_sample=False,
            cache_implementation="static",
            compile_config=config,
        )
        assert torch.equal(got, want)
        replays.append(info(device)["num_replays"])
    t = info(device)
    assert replays[-1] > replays[-2] > replays[0]  # still replaying at the end
    assert t["num_fallbacks"] == 0 and t["num_rerecords"] <= 2
    assert t["num_nodes"] <= 4  # the old caches' recordings were replaced, not kept


@pytest.mark.needs_values("generate() stops on token values read from the device")
@pytest.mark.parametrize(
    "inner",
    [
        pytest.param(
            None,
            id="as-in-recipe",
            marks=pytest.mark.needs_kernels(TRITON),
        ),
        pytest.param("aot_eager", id="aot_eager"),
    ],
)
def test_generate_with_one_static_cache_records_the_decode_step_once(device, inner):
    # docs/recipes.md's recipe: one StaticCache passed to every generate() call keeps the cache's
    # addresses, so the decode step is recorded once and replayed by every later call, with
    # either inner compiler. options= needs mode=None (torch.compile refuses both).
    torch._dynamo.reset()
    model = tiny_llama(device)
    ids = torch.randint(0, 128, (1, 6), device=device)
    want = model.generate(
        ids, max_new_tokens=8, do_sample=False, cache_implementation="static", disable_compile=True
    )
    if inner is None:  # the recipe's default inner compiler (Inductor)
        config = transformers.CompileConfig(backend="graphtrees")
    else:
        config = transformers.CompileConfig(
            backend="graphtrees", mode=None, options={"inner": inner}
        )
    config._compile_all_devices = True  # on CPU transformers compiles only when asked
    cache = transformers.StaticCache(config=model.config, max_cache_len=6 + 8)
    replays = []
    for _ in range(5):
        cache.reset()
        got = model.generate(
            ids,
            max_new_tokens=8,
            do_sample=False,
            compile_config=config,
            **{cache_argument(model): cache},
        )
        assert torch.equal(got, want)
        replays.append(info(device)["num_replays"])
    t = info(device)
    assert t["num_recordings"] == 1 and t["num_rerecords"] == 0 and t["num_fallbacks"] == 0, t
    assert replays == sorted(set(replays)) and replays[-1] - replays[-2] >= 6  # every step replays


def test_gpt2_wrapped_whole_with_its_default_cache_runs_eagerly(device, tree_logs):
    # use_cache=True (the default) returns a DynamicCache, which a graph cannot return: the
    # model runs eagerly with the reason and the hint logged once, and never raises.
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=64, n_positions=32)
    model = transformers.GPT2LMHeadModel(cfg).to(device).eval()
    g = graphtrees.cudagraphify(model)
    ids = torch.randint(0, 64, (1, 8), device=device)
    for _ in range(3):
        out = g(ids)
        assert_close(out.logits, model(ids).logits)
    assert out.past_key_values is not None
    (sig,) = g.signatures()
    assert "DynamicCache" in sig["eager_reason"] and "use_cache=False" in sig["eager_reason"]
    assert tree_logs.text.count("use_cache=False") == 1


@pytest.mark.parametrize("inner", ["aot_eager", "inductor"])
def test_compiled_llama_split_at_its_attention_matches_eager(device, inner):
    # torch.compile(backend="graphtrees") with splitting_ops on the attention (as vLLM splits
    # its models): each layer's attention runs eagerly, everything between is recorded.
    model = tiny_llama(device)
    options = {"inner": inner, "splitting_ops": ["aten::scaled_dot_product_attention"]}
    compiled = torch.compile(model, backend="graphtrees", options=options)
    gen = torch.Generator().manual_seed(3)
    for _ in range(4):
        ids = torch.randint(0, 128, (2, 16), generator=gen).to(device)
        out = compiled(input_ids=ids, use_cache=False)
        assert_close(out.logits, model(input_ids=ids, use_cache=False).logits)
    nodes = info(device)["nodes"]
    # 2 layers: 3 recorded pieces around 2 attentions
    assert [n["function"].split(".", 1)[1] for n in nodes] == [
        "inference[1/5]",
        "inference[3/5]",
        "inference[5/5]",
    ]
    assert all(n["replays"] == 2 for n in nodes), nodes
    assert info(device)["num_fallbacks"] == 0
    if inner == "aot_eager":
        assert_replays_ran_programs(device)


@pytest.mark.needs_values("greedy decoding feeds back token values read from the device")
@pytest.mark.parametrize(
    "inner",
    [
        "aot_eager",
        pytest.param(
            "inductor",
            marks=pytest.mark.needs_kernels(TRITON),
        ),
    ],
)
def test_compiled_llama_split_at_its_attention_decodes_with_a_static_cache(device, inner):
    # docs/training.md's piecewise recipe in a greedy loop: the StaticCache's layers are created
    # inside the first compiled call (after a splitting op), and the loop runs past chain_limit.
    torch._dynamo.reset()  # earlier tests compiled the same forward: no recompile limit here
    model = tiny_llama(device)
    prompt = torch.randint(0, 128, (1, 8), device=device)
    new_tokens = 24
    ref = model.generate(
        prompt,
        max_new_tokens=new_tokens,
        do_sample=False,
        cache_implementation="static",
        disable_compile=True,  # eager steps, as recorded: no auto-compiled reference
    )
    compiled = graphtrees.compile(
        model, inner=inner, splitting_ops=["aten::scaled_dot_product_attention"]
    )
    cache = transformers.StaticCache(config=model.config, max_cache_len=8 + new_tokens)
    arg = cache_argument(model)
    for attempt in range(2):
        cache.reset()
        tokens, ids, position = prompt, prompt, torch.arange(8, device=device)
        for _ in range(new_tokens):
            out = compiled(input_ids=ids, cache_position=position, use_cache=True, **{arg: cache})
            ids = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, ids], dim=1)
            position = torch.tensor([tokens.shape[1] - 1], device=device)
        assert torch.equal(tokens, ref), (attempt, tokens, ref)
    t = info(device)
    assert t["num_replays"] > new_tokens, t
    # On CUDA two pieces of the first call take a 0-dim CPU tensor of the static cache as an
    # input and run eagerly, with that reason (found on the CUDA stand-in's value mode).
    assert t["num_fallbacks"] == (0 if device == "cpu" else 2), t
    assert all("inference[" in n["function"] for n in t["nodes"]), t["nodes"]  # split pieces


def tiny_mixtral(device):
    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2)
    return transformers.MixtralForCausalLM(cfg).to(device).eval()


@pytest.mark.needs_kernels(
    "on CUDA the experts run torch._grouped_mm, whose float32 CUDA kernel copies its offsets to "
    "the host: the stand-in's value mode computes it first, with a sync that a capture refuses"
)
def test_compiled_mixtral_is_recorded_around_its_host_reading_expert_op(device, tree_logs):
    # Mixtral's routing (topk, sort, histc: values that depend on the data, shapes that do not)
    # is recorded. On CPU transformers runs the experts through its custom op
    # transformers::grouped_mm_fallback, whose implementation reads the routing on the host
    # (.tolist()): a capture rejects it, and the log names the op to put in splitting_ops. With
    # that entry, each layer's expert op runs eagerly between recorded pieces.
    model = tiny_mixtral(device)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1)).to(device)
    want = model(input_ids=ids, use_cache=False).logits
    op = "transformers::grouped_mm_fallback"
    for options in ({"inner": "aot_eager"}, {"inner": "aot_eager", "splitting_ops": [op]}):
        torch._dynamo.reset()
        graphtrees.reset()
        compiled = torch.compile(model, backend="graphtrees", options=options)
        for _ in range(4):
            got = compiled(input_ids=ids, use_cache=False).logits
            assert_close(got, want)
        t = info(device)
        if device == "cpu" and "splitting_ops" not in options:
            assert t["num_nodes"] == 0 and t["num_fallbacks"] > 0
            assert f"inside the custom op {op}; under torch.compile, splitting_ops=['{op}']" in (
                tree_logs.text
            )
    assert t["num_nodes"] >= 1 and t["num_fallbacks"] == 0, t
    assert all(n["replays"] == 2 for n in t["nodes"]), t["nodes"]
    if device == "cpu":
        (name, pieces), *_ = graphtrees.split_info().items()
        # Per layer, the two expert calls and the views between them are one eager piece: a
        # piece of views only would record an empty graph (views count as no op).
        assert [p["recorded"] for p in pieces] == [True, False] * 2 + [True], pieces
        assert all("grouped_mm_fallback x2" in p["why_eager"][0] for p in pieces[1::2]), pieces
        assert_replays_ran_programs(device)
