"""Makes docs/observability.md's pictures and reports: run it, commit what it writes.

    python scripts/observability_docs.py

writes (CPU emulation, seeded: the same numbers on every machine with the same torch)
  docs/images/seed_tree.svg        the seed story (examples/seed_tree.py's tree), by tree_to_svg
  docs/images/bucketed_decode.svg  a decode loop with batch buckets [1, 2, 4, 8]
  docs/observability_examples.md   graphtrees.report() of examples/llm_decode.py and of a model
                                   with a deliberate graph break, each run under
                                   `python -m graphtrees.report`
Needs Graphviz's dot (apt-get install graphviz) and transformers (for llm_decode.py).
"""

import json
import os
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import graphtrees  # noqa: E402
from graphtrees._report import _text  # noqa: E402


def seed_story():
    """examples/seed_tree.py's tree at a small width: g1 -> g2, then g1 -> g3, both replaying."""
    torch.manual_seed(0)

    def mlp(d_in, d_hidden, d_out):
        return torch.nn.Sequential(
            torch.nn.Linear(d_in, d_hidden), torch.nn.GELU(), torch.nn.Linear(d_hidden, d_out)
        )

    g1 = graphtrees.cudagraphify(mlp(64, 64, 64), name="g1")
    g2 = graphtrees.cudagraphify(mlp(64, 128, 64), name="g2")
    g3 = graphtrees.cudagraphify(mlp(64, 128, 64), name="g3")
    x = torch.randn(32, 64)
    with torch.no_grad():
        for head in [g2] * 3 + [g3] * 3 + [g2, g3] * 2:
            graphtrees.mark_step_begin()
            y = head(g1(x))
    return y


def bucketed_decode():
    """A serving loop's decode step over a changing batch of requests, padded to buckets
    [1, 2, 4, 8]: an embedding and a decode step per token, each bucket its own path."""
    torch.manual_seed(0)
    vocab, d = 128, 64
    table = torch.nn.Embedding(vocab, d)
    body = torch.nn.Sequential(
        torch.nn.Linear(d, 2 * d), torch.nn.SiLU(), torch.nn.Linear(2 * d, vocab)
    )
    embed = graphtrees.cudagraphify(table, name="embed", buckets=[1, 2, 4, 8])
    decode = graphtrees.cudagraphify(body, name="decode", buckets=[1, 2, 4, 8])
    batches = [1, 3, 3, 6, 8, 8, 5, 2, 2, 1, 7, 4, 4, 1]
    with torch.no_grad():
        tokens = torch.zeros(1, dtype=torch.long)
        for b in batches:
            tokens = torch.cat([tokens, tokens.new_zeros(max(0, b - tokens.numel()))])[:b]
            for _ in range(3):  # three tokens per batch composition
                graphtrees.mark_step_begin()
                tokens = decode(embed(tokens)).argmax(-1)
    return tokens


def graph_break_model():
    """A model with a deliberate graph break (torch._dynamo.graph_break()) and an op no recording
    can repeat (a host-side custom op), compiled with graphtrees: what the report shows."""

    @torch.library.custom_op("docs::host_op", mutates_args=(), tags=(torch.Tag.cudagraph_unsafe,))
    def host_op(x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @host_op.register_fake
    def _(x):
        return torch.empty_like(x)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 32)
            self.b = torch.nn.Linear(32, 32)

        def forward(self, x):
            h = torch.relu(self.a(x))
            h = torch.sigmoid(host_op(h)) + h  # graphtrees splits the graph around it
            torch._dynamo.graph_break()  # dynamo makes two graphs
            return self.b(h).tanh()

    torch.manual_seed(0)
    model = graphtrees.compile(Model().eval(), inner="aot_eager", min_piece_ops=1)
    x = torch.randn(8, 32)
    with torch.no_grad():
        for _ in range(20):
            graphtrees.mark_step_begin()
            model(x)


def report_of(argv):
    """`python -m graphtrees.report --json -- argv...`: the report as a dict."""
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run(
        [sys.executable, "-m", "graphtrees.report", "--json", "--", *argv],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        check=True,
    )
    out = r.stdout
    return json.loads(out[out.rindex("\n{\n") + 1 :] if "\n{\n" in out else out)


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--graph-break-model":
        graph_break_model()
        return
    images = os.path.join(ROOT, "docs", "images")
    os.makedirs(images, exist_ok=True)
    held = seed_story()  # held: its node is drawn with a live output
    graphtrees.tree_to_svg("cpu", path=os.path.join(images, "seed_tree.svg"))
    del held
    graphtrees.reset()
    held = bucketed_decode()
    graphtrees.tree_to_svg("cpu", path=os.path.join(images, "bucketed_decode.svg"))
    del held
    graphtrees.reset()

    llm = report_of(["examples/llm_decode.py", "--device", "cpu", "--tokens", "16"])
    broken = report_of(["scripts/observability_docs.py", "--graph-break-model"])
    lines = [
        "# graphtrees.report() on two programs",
        "",
        "Made by `python scripts/observability_docs.py` (CPU emulation, torch "
        f"{torch.__version__.split('+')[0]}); each program ran under "
        "`python -m graphtrees.report -- ...`. See [observability.md](observability.md).",
        "",
        "## examples/llm_decode.py --device cpu --tokens 16",
        "",
        "```",
        _text(llm),
        "```",
        "",
        "## A model with a deliberate graph break and an op no recording can repeat",
        "",
        "`graph_break_model()` in scripts/observability_docs.py: `torch._dynamo.graph_break()` "
        "makes two dynamo graphs; graphtrees splits the first around a host-side custom op "
        "(`cudagraph_unsafe`) into two recorded pieces and one eager piece; 20 calls.",
        "",
        "```",
        _text(broken),
        "```",
        "",
    ]
    with open(os.path.join(ROOT, "docs", "observability_examples.md"), "w") as f:
        f.write("\n".join(lines))
    print(
        "wrote docs/images/seed_tree.svg, docs/images/bucketed_decode.svg, "
        "docs/observability_examples.md"
    )


if __name__ == "__main__":
    main()
