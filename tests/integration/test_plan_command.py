"""`epdserve plan` end to end: a real engine of the tiny model profiled in its own process, the plan printed and
written, the profile saved and planned from again; bad options refused in one line."""
import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow  # an engine profiled in a subprocess: about ten seconds

PLAN = [sys.executable, "-m", "epdserve.services.cli", "plan"]
TRAFFIC = ["--request-rate", "2", "--input-len", "32", "--output-len", "16", "--ttft-slo", "1", "--tpot-slo", "0.2"]


def plan(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*PLAN, *args], capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def planned(tiny_model_paths, tmp_path_factory):
    out = tmp_path_factory.mktemp("plan")
    done = plan("--model", tiny_model_paths["llama"], *TRAFFIC, "--threads", "1", "--prompt-lens", "8,64",
                "--batches", "1,4", "--num-kv-blocks", "64", "--save-profile", str(out / "profile.json"),
                "--output", str(out / "plan.json"))
    assert done.returncode == 0, done.stderr
    return done, json.loads((out / "profile.json").read_text()), json.loads((out / "plan.json").read_text()), out


def test_the_profile_is_measured_on_the_engine(planned):
    _, profile, _, _ = planned
    assert [n for n, _ in profile["prefill"]] == [8, 32, 64]  # the traffic's own prompt length too
    assert [b for b, _ in profile["decode"]] == [1, 4]
    assert all(seconds > 0 for _, seconds in profile["prefill"] + profile["decode"])
    assert profile["context_len"] == 32 and profile["threads"] == 1 and profile["encode"] is None


def test_every_layout_is_weighed_and_the_best_printed_with_its_command(planned, tiny_model_paths):
    done, profile, written, _ = planned
    layouts = written["layouts"]
    assert [entry["layout"] for entry in layouts] and {"1U", "0E1P1D"} <= {entry["layout"] for entry in layouts}
    assert written["profile"] == profile and written["traffic"]["rate"] == 2
    assert all(entry["ttft_p50"] > 0 and entry["tpot_p50"] > 0 for entry in layouts)  # medians beside the means
    assert "TTFT p50" in done.stdout and "TPOT p50" in done.stdout
    best = layouts[0]
    assert f"recommended: {best['layout']}" in done.stdout
    assert f"epdserve up --model {tiny_model_paths['llama']}" in done.stdout
    meeting = [entry for entry in layouts if entry["meets_slo"]]
    if meeting:  # the fewest instances among those that meet both SLOs comes first
        assert best["meets_slo"] and best["ttft"] <= 1 and best["tpot"] <= 0.2
        assert sum(best["counts"].values()) == min(sum(entry["counts"].values()) for entry in meeting)


def test_a_saved_profile_plans_without_measuring(planned):
    _, _, written, out = planned
    again = plan("--profile", str(out / "profile.json"), *TRAFFIC, "--output", str(out / "again.json"))
    assert again.returncode == 0, again.stderr
    assert "profiling" not in again.stderr
    assert json.loads((out / "again.json").read_text())["layouts"] == written["layouts"]


@pytest.mark.parametrize("args, error", [
    (["--request-rate", "0"], "--request-rate must be above 0"),
    (["--ttft-slo", "nan"], "--ttft-slo must be above 0"),
    (["--batches", "0,4"], "integers of at least 1"),
    (["--images-per-request", "-1"], "--images-per-request must be at least 0"),
])
def test_bad_options_are_refused_in_one_line(planned, args, error):
    _, _, _, out = planned
    done = plan("--profile", str(out / "profile.json"), *TRAFFIC, *args)
    assert done.returncode != 0 and error in done.stderr, done.stderr


def test_a_text_profile_cannot_plan_images(planned):
    _, _, _, out = planned
    done = plan("--profile", str(out / "profile.json"), *TRAFFIC, "--images-per-request", "1")
    assert done.returncode != 0 and "no vision tower" in done.stderr, done.stderr
