"""Shape buckets (Note [Buckets]): batches padded up to a recorded bucket and narrowed back,
eager above the largest bucket, and capture() recording every bucket ahead of time."""

import pytest
import torch

from graphtrees import cudagraphify

from helpers import assert_close, assert_invariants, info

pytestmark = pytest.mark.usefixtures("no_grad")

BUCKETS = [1, 2, 4, 8]


def mlp(x, w):
    return torch.relu(x @ w) + 1, (x @ w).amax(0)


def test_every_batch_size_pads_and_matches_eager(device):
    torch.manual_seed(0)
    w = torch.randn(16, 8, device=device)
    f = cudagraphify(lambda x, w: torch.relu(x @ w) + 1, static_argnums=(1,), buckets=BUCKETS)
    for _ in range(3):
        for b in range(1, 9):
            x = torch.randn(b, 16, device=device)
            out = f(x, w)
            assert out.shape == (b, 8)
            assert_close(out, torch.relu(x @ w) + 1)
    assert len(f.signatures()) == len(BUCKETS)
    assert info(device)["num_replays"] > 8
    assert_invariants(device)


def test_above_the_largest_bucket_runs_eagerly(device, tree_logs):
    f = cudagraphify(lambda x: x * 2, buckets=BUCKETS)
    for b in (9, 12, 9):
        x = torch.randn(b, 4, device=device)
        assert_close(f(x), x * 2)
    assert tree_logs.text.count("above the largest bucket (8)") == 1
    assert info(device)["num_nodes"] == 0


def test_results_that_are_not_batch_shaped_are_left_alone(device):
    w = torch.randn(16, 8, device=device)
    f = cudagraphify(mlp, static_argnums=(1,), buckets=BUCKETS)
    for _ in range(3):
        x = torch.randn(3, 16, device=device).abs()
        y, peak = f(x, w)
        ref_y, _ = mlp(x, w)
        assert y.shape == (3, 8) and peak.shape == (8,)  # (8,) is w's width, not the bucket
        assert_close(y, ref_y)


def test_the_same_tensor_twice_is_padded_once(device):
    # Padded position by position, it became two tensors: the function saw `a is not b`.
    g = cudagraphify(lambda a, b: a * 2 if a is b else a * 0 - 1, buckets=[8])
    x = torch.randn(5, 3, device=device)
    for _ in range(3):
        assert_close(g(x, x), x * 2)


def test_static_inputs_are_never_padded(device):
    table = torch.randn(3, 5, device=device)  # batch-sized along dim 0, but static
    f = cudagraphify(lambda x, t: x[:, :5] + t.sum(0), static_argnums=(1,), buckets=[4])
    for _ in range(3):
        x = torch.randn(3, 6, device=device)
        assert_close(f(x, table), x[:, :5] + table.sum(0))


def test_capture_records_every_bucket_largest_first(device):
    w = torch.randn(16, 8, device=device)
    f = cudagraphify(lambda x, w: torch.tanh(x @ w), static_argnums=(1,), buckets=BUCKETS)
    reports = f.capture(torch.randn(3, 16, device=device), w, progress=False)
    assert [r["size"] for r in reports] == [8, 4, 2, 1]
    assert all(r["status"] == "recorded" and r["seconds"] >= 0 for r in reports), reports
    assert reports[-1]["pool_bytes_after"] >= reports[0]["pool_bytes_after"] > 0
    recordings = info(device)["num_recordings"]
    assert recordings == 4
    for b in range(1, 9):
        x = torch.randn(b, 16, device=device)
        assert_close(f(x, w), torch.tanh(x @ w))
    assert info(device)["num_recordings"] == recordings  # everything replays


def test_capture_reports_a_bucket_that_runs_eagerly(device):
    f = cudagraphify(lambda x: x * 2 if x.sum() > 0 else x, buckets=[2, 4])
    reports = f.capture(torch.ones(3, 4, device=device), progress=False)
    assert [r["status"] for r in reports] == ["eager", "eager"]
    assert "cannot be recorded" in reports[0]["reason"]


def test_buckets_are_validated():
    for bad in ([], [0, 2], "8", [2.5]):
        with pytest.raises(ValueError, match="buckets must be a non-empty sequence"):
            cudagraphify(lambda x: x, buckets=bad)
    with pytest.raises(ValueError, match="needs graphtrees.cudagraphify"):
        cudagraphify(lambda x: x).capture(torch.ones(2))


def test_capture_progress_is_log_lines_off_a_terminal(capfd, caplog):
    # A bar refreshes by rewriting its line: in a log file or CI that is a line per refresh.
    f = cudagraphify(lambda x: x * 2, buckets=BUCKETS)
    with caplog.at_level("INFO", logger="graphtrees"):
        f.capture(torch.ones(3, 4))
    err = capfd.readouterr().err
    assert "\r" not in err and "bucket/s" not in err
    assert sum("capture: " in r.getMessage() for r in caplog.records) == len(BUCKETS)
