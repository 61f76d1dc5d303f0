"""Instruction count of graphtrees' call path, for before/after comparisons that wall-clock time on
a shared 2-core machine cannot settle (measurements, not a test):

    valgrind --tool=callgrind --collect-atstart=no \
        --toggle-collect='graphtrees::GraphedCallable::call(*' \
        python benchmarks/callgrind_calls.py <checkout with a built graphtrees> 500

counts the instructions inside GraphedCallable::call (`call(*`: a pattern `call*` also matches
callExact, and its second match switches the collection off inside it; flattening, the tree, the CPU replay
re-running the function, rebuilding the results) for 6 warmup/recording calls and 2 x 500 replays
of a 1-input and an 8-input function.
"""

import sys

root = sys.argv[1]
sys.path.insert(0, root)
import torch

import graphtrees


def f1(x):
    return x * 2 + 1


def f8(*xs):
    return tuple(x * 2 + 1 for x in xs)


g1 = graphtrees.cudagraphify(f1)
g8 = graphtrees.cudagraphify(f8)
x = torch.randn(64)
xs = [torch.randn(64) for _ in range(8)]
with torch.no_grad():
    for _ in range(3):
        g1(x)
        g8(*xs)
    for _ in range(int(sys.argv[2])):
        g1(x)
    for _ in range(int(sys.argv[2])):
        g8(*xs)
print(graphtrees.__file__, graphtrees.tree_info("cpu")["num_replays"])
