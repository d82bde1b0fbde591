"""`sekv-local bench`: a real (tiny) grid end to end, then resumed without recomputing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from sekv_local.errors import SekvError
from sekv_local.eval.runner import BenchConfig
from sekv_local.method_variant import parse_method_options, split_variant


@pytest.mark.slow
def test_quick_bench_writes_results_and_resumes(tmp_path: Path, model_path) -> None:
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "sekv_local", "bench", "--quick", "--engine", "torch,llama.cpp-stock",
           "--method", "full,sekv", "--budgets", "0.8", "--threads", "2", "--out", str(out)]
    first = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert first.returncode == 0, first.stderr
    results = json.loads((out / "results.json").read_text())
    records = results["records"]
    # torch: full + sekv; llama.cpp-stock: full only (sekv is skipped there, with a notice)
    assert sorted({(r["engine"], r["method"]) for r in records}) == [
        ("llama.cpp-stock", "full"), ("torch", "full"), ("torch", "sekv")]
    assert "skipping sekv on llama.cpp-stock" in first.stderr
    assert len(records) == 3 * 2 and all(r["length"] == 1024 and r["task"] == "niah_single" for r in records)
    for r in records:
        assert 0.0 <= r["score"] <= 1.0 and r["prefill_tokens"] > 900 and r["decode_tokens"] >= 1
        assert r["device_bytes"] > 0 and r["full_kv_bytes"] > 0
    sekv = [r for r in records if r["method"] == "sekv"]
    assert all(r["device_peak_bytes"] <= 0.8 * r["full_kv_bytes"] * 1.1 for r in sekv)
    summary = (out / "summary.md").read_text()
    assert "| torch | sekv | 80% |" in summary and "sekv-local bench --quick" in summary
    for png in ("accuracy_by_length.png", "depth_heatmap.png", "accuracy_vs_budget.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert json.loads((out / "results.json").read_text())["records"] == records  # nothing recomputed


@pytest.mark.slow
def test_bench_records_a_budget_the_method_refuses_and_goes_on(tmp_path: Path, model_path) -> None:
    from sekv_local.eval.runner import run_bench

    config = BenchConfig(tasks=["niah_single"], lengths=[1024], samples=1, engines=["torch"], methods=["sekv"],
                         budgets=[0.05], threads=2, out=str(tmp_path / "b"))
    paths = run_bench(config, show_progress=False)
    results = json.loads(paths["results"].read_text())
    assert results["records"] == []
    assert len(results["refused"]) == 1 and "cannot hold even the minimum" in results["refused"][0]["reason"]
    assert "## Refused cells" in paths["summary"].read_text()
    run_bench(config, show_progress=False)  # resumed: the refused cell counts as done, not retried
    assert len(json.loads(paths["results"].read_text())["refused"]) == 1


def test_bench_records_a_length_beyond_the_method_and_goes_on(tmp_path: Path, model_path) -> None:
    from sekv_local.eval.runner import run_bench

    config = BenchConfig(tasks=["niah_single"], lengths=[9216], samples=1, engines=["torch"], methods=["full"],
                         threads=2, out=str(tmp_path / "b"))
    results = json.loads(run_bench(config, show_progress=False)["results"].read_text())
    assert results["records"] == []
    assert len(results["refused"]) == 1 and "8192" in results["refused"][0]["reason"]


def test_resuming_with_another_sample_count_is_refused(tmp_path: Path, model_path) -> None:
    """Needle depths are spread over --samples, so sample 1 of a 2-sample suite is another question than
    sample 1 of a 3-sample one: resuming must not mix them."""
    from sekv_local.eval.runner import run_bench

    def config(samples: int, seed: int = 1) -> BenchConfig:
        return BenchConfig(tasks=["niah_single"], lengths=[9216], samples=samples, seed=seed, engines=["torch"],
                           methods=["full"], threads=2, out=str(tmp_path / "b"))

    results = run_bench(config(2), show_progress=False)["results"]
    before = results.read_text()
    with pytest.raises(SekvError, match="--samples 2, this run asks for --samples 3"):
        run_bench(config(3), show_progress=False)
    with pytest.raises(SekvError, match="--seed 1, this run asks for --seed 7"):
        run_bench(config(2, seed=7), show_progress=False)
    assert results.read_text() == before  # nothing lost
    run_bench(config(2), show_progress=False)  # the same questions resume
    assert len(json.loads(results.read_text())["refused"]) == 2


def test_bench_config_validation() -> None:
    with pytest.raises(SekvError, match="unknown task"):
        BenchConfig(tasks=["nope"], lengths=[1024], samples=1, engines=["torch"], methods=["full"])
    with pytest.raises(SekvError, match="needs --budgets"):
        list(BenchConfig(tasks=["niah_single"], lengths=[1024], samples=1, engines=["torch"],
                         methods=["sekv"]).method_budgets())
    assert parse_method_options(["sekv:zoom_k=32", "sekv:router=projection", "snapkv:window=64"]) == {
        "sekv": {"zoom_k": 32, "router": "projection"}, "snapkv": {"window": 64}}
    with pytest.raises(SekvError, match="METHOD:KEY=VALUE"):
        parse_method_options(["zoom_k=32"])


def test_method_variants_carry_their_own_options() -> None:
    config = BenchConfig(tasks=["niah_single"], lengths=[1024], samples=1, engines=["torch"],
                         methods=["full", "xkv@group=2", "xkv@group=4@reconstruct=dense"], budgets=[0.25],
                         method_options=parse_method_options(["xkv:v_share=0.5", "xkv:group=1"]))
    assert split_variant("xkv@group=2@energy=0.9") == ("xkv", {"group": 2, "energy": 0.9})
    # --option gives the base method's settings; a variant's own settings win
    assert config.options_of("xkv@group=2") == {"v_share": 0.5, "group": 2}
    assert config.options_of("xkv@group=4@reconstruct=dense") == {"v_share": 0.5, "group": 4, "reconstruct": "dense"}
    assert list(config.method_budgets()) == [("full", None), ("xkv@group=2", 0.25),
                                             ("xkv@group=4@reconstruct=dense", 0.25)]
    with pytest.raises(SekvError, match="METHOD@KEY=VALUE"):
        BenchConfig(tasks=["niah_single"], lengths=[1024], samples=1, engines=["torch"], methods=["xkv@group"])


def test_a_variant_may_name_its_own_budget() -> None:
    config = BenchConfig(tasks=["niah_single"], lengths=[1024], samples=1, engines=["torch"],
                         methods=["full", "sekv", "sekv@budget=0.125@zoom_k=8"], budgets=[0.25])
    assert list(config.method_budgets()) == [("full", None), ("sekv", 0.25), ("sekv@budget=0.125@zoom_k=8", 0.125)]
    assert config.options_of("sekv@budget=0.125@zoom_k=8") == {"zoom_k": 8}  # the budget is not a method option
    with pytest.raises(SekvError, match="takes no budget"):
        list(BenchConfig(tasks=["niah_single"], lengths=[1024], samples=1, engines=["torch"],
                         methods=["full@budget=0.5"], budgets=[0.25]).method_budgets())


def test_absolute_budgets_parse_and_print_as_sizes() -> None:
    from sekv_local.cache.budget import parse_budget
    from sekv_local.eval.report import fmt_budget

    assert parse_budget("25%") == 0.25 and parse_budget("0.125") == 0.125
    assert parse_budget("64MiB") == 64 * 2**20 and parse_budget("500KB") == 500_000
    with pytest.raises(SekvError, match="not a budget"):
        parse_budget("lots")
    config = BenchConfig.from_cli("niah_single", "16k,32k", 1, "torch", "sekv@positions=bounded", "48MiB", "smollm2-135m",
                                  1, None, 1024, Path("x"), False, "")
    assert config.budgets == [48 * 2**20]
    assert fmt_budget(48 * 2**20) == "48 MiB" and fmt_budget(0.25) == "25%" and fmt_budget(None) == "-"


def test_plan_order_method_by_method_or_interleaved_and_skips_done_cells() -> None:
    from sekv_local.eval.runner import _cell_key, plan_cells

    grid = dict(tasks=["niah_single", "doc_qa"], lengths=[1024, 2048], samples=2, engines=["torch"],
                methods=["full", "snapkv"], budgets=[0.25])
    by_method = plan_cells(BenchConfig(**grid))
    assert len(by_method) == 16
    assert [c[1] for c in by_method[:8]] == ["full"] * 8  # one method's whole grid, then the next
    assert by_method[:3] == [("torch", "full", None, 1024, "niah_single", 0), ("torch", "full", None, 1024, "niah_single", 1),
                             ("torch", "full", None, 1024, "doc_qa", 0)]
    interleaved = plan_cells(BenchConfig(**grid, interleave=True))
    assert sorted(interleaved) == sorted(by_method)
    assert interleaved[:4] == [("torch", "full", None, 1024, "niah_single", 0), ("torch", "snapkv", 0.25, 1024, "niah_single", 0),
                               ("torch", "full", None, 1024, "niah_single", 1), ("torch", "snapkv", 0.25, 1024, "niah_single", 1)]
    done = {_cell_key("torch", "snapkv", 0.25, "niah_single", 1024, 0, {})}
    assert ("torch", "snapkv", 0.25, 1024, "niah_single", 0) not in plan_cells(BenchConfig(**grid, interleave=True), done)
    shared = dict(grid, engines=["torch", "llama.cpp"], methods=["sekv"], shared_prefill=True)
    for interleave in (False, True):  # each cell's engines back to back, the source first
        plan = plan_cells(BenchConfig(**shared, interleave=interleave))
        assert [c[0] for c in plan[:4]] == ["torch", "llama.cpp", "torch", "llama.cpp"]
        assert plan[0][3:] == plan[1][3:]


def test_bench_device_is_resolved_up_front() -> None:
    import torch

    grid = dict(tasks=["niah_single"], lengths=[1024], samples=1, engines=["torch"], methods=["full"])
    assert BenchConfig(**grid).device == "cpu"
    assert BenchConfig(**grid, device="auto").device == ("cuda" if torch.cuda.is_available() else "cpu")
    if not torch.cuda.is_available():
        with pytest.raises(SekvError, match="no CUDA device"):
            BenchConfig(**grid, device="cuda")
