"""The float8 gate's benchmarks on the CPU: the parity step at --preset tiny, and the interval the toy-tau
comparison reports. (tests/test_benchmarks.py runs the other benchmark scripts; these two run here.)"""

import json
import subprocess
import sys

import pytest
from conftest import REPO

sys.path.insert(0, str(REPO / "benchmarks"))
from harness import ENVELOPE  # noqa: E402
from toy_bench import bootstrap_diff  # noqa: E402


@pytest.fixture(scope="module")
def parity(tmp_path_factory):
    work = tmp_path_factory.mktemp("fp8-parity")
    out = work / "parity.json"
    proc = subprocess.run(
        [sys.executable, "fp8_parity.py", "--preset", "tiny", "--work", str(work), "--out", str(out)],
        cwd=REPO / "benchmarks",
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert all(k in result for k in ENVELOPE) and result["benchmark"] == "fp8_parity"
    return result


def test_parity_measures_float8_against_a_noise_floor_of_the_same_step(parity):
    v = parity["variants"]
    assert set(v) == {"bf16", "bf16_split", "fp8_tensorwise", "fp8_rowwise"}
    floor = v["bf16_split"]
    # the split reaches the same gradient by another reduction order: float32 on the CPU, rounding only
    assert floor["grad"]["all"] < 1e-4 and floor["loss_rel_diff"] < 1e-5
    for name in ("fp8_tensorwise", "fp8_rowwise"):
        r = v[name]
        # float8 matmuls really ran (far off the floor), and the step is still the same step
        assert r["grad"]["all"] > 100 * floor["grad"]["all"] and r["grad"]["all"] < 0.5
        assert r["ratio_to_noise"]["grad"] > 100
        assert r["loss_rel_diff"] < 0.01
        # every parameter tensor of the drafter is compared, gradient and update
        assert set(r["per_tensor"]) == set(v["bf16_split"]["per_tensor"])
        assert len(r["per_tensor"]) > 10
        assert all(t["grad"] is not None and t["update"] is not None for t in r["per_tensor"].values())
        assert r["grad"]["median_tensor"] <= r["grad"]["max_tensor"]


def test_bootstrap_interval_holds_the_difference_and_moves_with_it():
    base = [3.4, 3.6, 3.5, 3.7, 3.3]
    lo, hi = bootstrap_diff(base, base)
    assert lo < 0 < hi and abs(lo + hi) < 0.05  # no difference: an interval about zero
    lo2, hi2 = bootstrap_diff([x + 1 for x in base], base)
    assert 0 < lo2 < 1 < hi2  # a shift of one: the interval holds it and leaves zero out
    assert abs((hi2 - lo2) - (hi - lo)) < 0.05  # the same spread, the same width


def test_the_committed_gate_is_what_its_script_makes_of_the_committed_results(tmp_path):
    out = tmp_path / "gate.json"
    proc = subprocess.run(
        [sys.executable, "fp8_gate.py", "--out", str(out)],
        cwd=REPO / "benchmarks",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    gate = json.loads(out.read_text())
    assert gate["benchmark"] == "fp8_gate" and gate["argv"][0] == "benchmarks/fp8_gate.py"
    # the decision and its figures; the envelope says where and when it was made (the committed one has none)
    committed = json.loads((REPO / "benchmarks/results/fp8_gate.json").read_text())
    drop = (*ENVELOPE, "params")
    assert {k: v for k, v in gate.items() if k not in drop} == {
        k: v for k, v in committed.items() if k not in drop
    }


def test_the_gate_keeps_float8_only_within_the_loss_gap_and_intervals():
    from fp8_gate import decide

    def curves(gap, complete=True, objective="decay", sim=(3.0, 3.0)):
        """A curve comparison: the logged loss's gap, and float8's and bf16's validation sim_tau at the
        last step (300) and at one before the last 100 steps (ignored)."""
        val = {"150": {"variant": 1.0, "bf16": 2.0}, "300": {"variant": sim[0], "bf16": sim[1]}}
        return {
            "runs": {"bf16": {"complete": True}, "fp8_tensorwise": {"complete": complete}},
            "train": {"loss": objective},
            "shape": {"steps": 300},
            "vs_bf16": {"fp8_tensorwise": {"loss_rel_gap_last_100": gap, "val_sim_tau": val}},
        }

    def quality(shift):  # five seeds each; float8's tau and sim_tau moved by `shift`
        base = [3.4, 3.6, 3.5, 3.7, 3.3]
        runs = {
            f"{v}-seed{s}": {"name": f"{v}-seed{s}", "tau_pooled": t + d, "final_sim_tau": t + d}
            for v, d in (("bf16", 0), ("fp8", shift))
            for s, t in enumerate(base)
        }
        return {
            "runs": runs,
            "variants": {
                "bf16": {"overrides": {"train.fp8": None}},
                "fp8": {"overrides": {"train.fp8": "tensorwise"}},
            },
        }

    assert decide(curves(0.005), quality(0.0), "tensorwise")["decision"] == "keep train.fp8: tensorwise"
    assert decide(curves(0.005), quality(0.5), "tensorwise")["decision"].startswith("keep")  # favours float8
    assert decide(curves(0.02), quality(0.0), "tensorwise")["decision"].startswith("move to bf16")
    assert decide(curves(0.005), quality(-1.0), "tensorwise")["decision"].startswith("move to bf16")
    undecided = decide(curves(None, complete=False), quality(0.0), "tensorwise")
    assert undecided["decision"] == "undecided" and undecided["missing"]
    # under dpace the logged loss grows as the drafter improves: the validation sim_tau is the measure
    dpace = decide(curves(0.2, objective="dpace", sim=(3.9, 3.9)), quality(0.0), "tensorwise")
    assert dpace["decision"].startswith("keep") and dpace["val_sim_tau_rel_diff_min_last_100"] == 0.0
    assert decide(curves(0.2, objective="dpace", sim=(5.0, 3.9)), quality(0.0), "tensorwise")[
        "decision"
    ].startswith("keep")  # favours float8
    assert decide(curves(0.0, objective="dpace", sim=(3.8, 3.9)), quality(0.0), "tensorwise")[
        "decision"
    ].startswith("move to bf16")  # 2.6% below bf16
    assert decide(curves(0.2, objective="decay", sim=(5.0, 3.9)), quality(0.0), "tensorwise")[
        "decision"
    ].startswith("move to bf16")  # a mean CE: its gap counts
