"""Every benchmark end to end on the tiny config (1 rep, few steps, small world): the JSON has the figures.

No timing assertions (the machine is shared and noisy): only that each figure exists and is sane.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import pytest

from elastic_qa.bench.cli import main

pytestmark = [pytest.mark.integration, pytest.mark.bench]
REPLICAS = importlib.util.find_spec("torchft") is not None  # the replica-group mode's extra


def bench(tmp_path: Path, *argv: str) -> dict[str, Any]:
    out = tmp_path / "figures.json"
    assert main([*argv, "--json", str(out), "--work-dir", str(tmp_path / "work")]) == 0
    return json.loads(out.read_text())


def positive(stat: dict[str, Any]) -> bool:
    return 0 < stat["min"] <= stat["median"] <= stat["max"] and all(v > 0 for v in stat["values"])


def test_throughput(tmp_path: Path, cache_dir: Path) -> None:
    result = bench(
        tmp_path,
        "throughput",
        "--config",
        "tiny",
        "--reps",
        "1",
        "--steps",
        "20",
        f"data.cache_dir={cache_dir}",
    )
    assert result["ratio"] > 0 and positive(result["ratio_spread"]) and result["ratio_median_chunks"] > 0
    assert set(result["variants"]) == {"plain", "product"}
    for variant in result["variants"].values():
        assert positive(variant["steps_per_s"]) and positive(variant["samples_per_s"])
    assert result["settings"]["world_size"] == 2 and result["settings"]["steps"] == 20
    assert result["variants"]["product"]["breakdown_ms"]["forward_backward_s"] > 0


def test_overhead_times_every_side_in_the_same_job_and_the_product_trains_every_timed_step(
    tmp_path: Path, cache_dir: Path
) -> None:
    sides = "skeleton,skeleton2,recipe,product"
    result = bench(
        tmp_path,
        "overhead",
        "--config",
        "tiny",
        "--reps",
        "1",
        "--rounds",
        "3",
        "--block",
        "5",
        "--sides",
        sides,
        f"data.cache_dir={cache_dir}",
    )
    assert result["settings"]["sides"] == sides.split(",") and result["settings"]["block"] == 5
    (times,) = result["block_s"]
    assert {side: len(blocks) for side, blocks in times.items()} == dict.fromkeys(sides.split(","), 3)
    assert set(result["pooled"]) == {
        "skeleton2/skeleton",
        "recipe/skeleton",
        "recipe/skeleton2",
        "product/skeleton",
        "product/skeleton2",
        "product/recipe",
    }
    for key, pooled in result["pooled"].items():
        later, earlier = key.split("/")
        assert pooled["ratio_of_totals"] == pytest.approx(sum(times[later]) / sum(times[earlier]))
        assert pooled["ci95"][0] <= pooled["ratio_of_totals"] <= pooled["ci95"][1]
        assert pooled == result["per_rep"][0][key]  # one rep: pooled is that rep
    assert result["goal"] == 1.02 and isinstance(result["goal_met"], bool)
    # The product side is the real trainer: its step lines, up to the last of the 4 rounds' steps (with the
    # warm-up round), in its own run directory.
    logs = tmp_path / "work" / "rep-0" / "logs"
    steps = [
        row["step"]
        for row in map(json.loads, "".join(f.read_text() for f in logs.glob("rank-000*")).splitlines())
        if row["event"] == "step"
    ]
    assert steps == list(range(5, 4 * 5 + 1, 5))


@pytest.mark.long  # two cold compiles of the tiny model: ~1 min on 2 cores, more under load
def test_compile(tmp_path: Path, cache_dir: Path) -> None:
    result = bench(
        tmp_path, "compile", "--config", "tiny", "--reps", "1", "--steps", "20", f"data.cache_dir={cache_dir}"
    )
    assert set(result["variants"]) == {"eager", "compiled"} and result["ratio"] > 0
    for variant in result["variants"].values():
        assert positive(variant["steps_per_s"])
    assert result["compiled_first_step_s"]["median"] > 0 and result["compiled_compile_s"]["median"] > 0


def test_checkpoint(tmp_path: Path) -> None:
    result = bench(tmp_path, "checkpoint", "--models", "tiny", "--reps", "1")
    tiny = result["models"]["tiny"]
    assert tiny["parameters"] > 0 and tiny["bytes"] > 0
    assert positive(tiny["stall_s"]) and positive(tiny["sync_s"]) and positive(tiny["async_total_s"])
    assert positive(tiny["background_s"]) and positive(tiny["load_s"]) and positive(tiny["apply_s"])
    assert tiny["stall_ratio"] > 0 and "goal_met" in result


def test_checkpoint_of_a_model_dir_measures_only_that_model_with_fewer_reps(
    tmp_path: Path, hf_models: dict
) -> None:
    result = bench(tmp_path, "checkpoint", "--model-dir", str(hf_models["bert"]))
    assert list(result["models"]) == ["bert"] and result["settings"]["reps"] == 2
    bert = result["models"]["bert"]
    assert bert["model"]["kind"] == "hf" and bert["model"]["name_or_path"] == str(hf_models["bert"].resolve())
    assert set(bert["file_bytes"]) == {"model.pt", "optimizer.pt", "trainer.pt"}
    assert bert["bytes"] == sum(bert["file_bytes"].values())
    # fp32 weights and AdamW's two moments: at least 3 x 4 bytes a parameter
    assert bert["bytes"] > 12 * bert["parameters"]
    assert len(bert["restore_s"]["values"]) == 2 and positive(bert["restore_s"])


def test_probe_runs_in_a_fresh_process_and_finds_the_invariant_tensors(
    tmp_path: Path, hf_models: dict
) -> None:
    result = bench(tmp_path, "probe", "--model-dir", str(hf_models["bert"]), "--reps", "1")
    bert = result["models"]["bert"]
    assert bert["frozen"] == 4  # 2 key biases, the QA bias, the last LayerNorm bias
    assert positive(bert["seconds"]) and positive(bert["copy_seconds"])
    assert bert["peak_after_bytes"]["median"] >= bert["peak_before_bytes"]["median"] > 0
    assert bert["added_bytes"]["median"] > 0


def test_resume(tmp_path: Path, cache_dir: Path) -> None:
    result = bench(
        tmp_path,
        "resume",
        "--config",
        "tiny",
        "--reps",
        "1",
        "--positions",
        "0,99",
        f"data.cache_dir={cache_dir}",
    )
    assert set(result["positions"]) == {"0%", "99%"}
    assert result["positions"]["0%"]["cursor"] == 0 and result["positions"]["99%"]["cursor"] > 0
    for position in result["positions"].values():
        assert positive(position["first_step_s"]) and positive(position["resume_event_s"])
    assert result["max_over_min"] >= 1


def test_recovery(tmp_path: Path, cache_dir: Path) -> None:
    result = bench(
        tmp_path,
        "recovery",
        "--config",
        "tiny",
        "--reps",
        "1",
        "--cases",
        "worker",
        "--kill-after",
        "2",
        *(["--replicas"] if REPLICAS else []),
        f"data.cache_dir={cache_dir}",
    )
    worker = result["cases"]["worker"]
    for variant in ("product", "bare"):
        assert positive(worker[variant]["first_step_s"]) and worker[variant]["new_world_size"] == 2
    assert worker["ratio"] > 0
    if REPLICAS:  # the replica mode's kill: survivors step first, the killed group heals, then trains again
        replicas = worker["replicas"]
        assert replicas["survivor_s"]["median"] < replicas["rejoin_s"]["median"]
        assert replicas["heal_s"]["median"] <= replicas["rejoin_s"]["median"]
        assert replicas["ledger"]["ok"] and replicas["rejoin_to_bare"] > 0
    # Where the product's seconds went: the survivor's side, the new process's birth, its start-up phases.
    timeline = worker["product"]["timeline"]
    assert 0 < timeline["noticed"] <= timeline["saved"] < timeline["born"] < timeline["first_step_at"]
    assert {"imports", "process_group", "model", "probe", "restore", "first_step"} <= set(timeline)


def test_scaling(tmp_path: Path, cache_dir: Path) -> None:
    result = bench(
        tmp_path, "scaling", "--config", "tiny", "--reps", "1", "--steps", "20", f"data.cache_dir={cache_dir}"
    )
    assert set(result["world_sizes"]) == {"1", "2"}
    assert result["world_sizes"]["1"]["speedup"] == 1.0
    for world in result["world_sizes"].values():
        assert positive(world["samples_per_s"]) and world["speedup"] > 0
        assert world["comm_share"] is None or 0 <= world["comm_share"]["median"] <= 1


def test_drift(tmp_path: Path, cache_dir: Path) -> None:
    result = bench(
        tmp_path,
        "drift",
        "--world-sizes",
        "2",
        "--steps",
        "6",
        "--every",
        "3",
        "--resize",
        "1:2",
        f"data.cache_dir={cache_dir}",
    )
    table = result["relative_difference"]
    assert set(table) == {"2", "1->2"}
    for differences in table.values():
        assert set(differences) == {"3", "6"} and all(0 <= d < 1e-3 for d in differences.values())


def test_emergency_measures_both_variants_on_both_storages_and_leaves_no_node_local_copy(
    tmp_path: Path, hf_models: dict
) -> None:
    node_local = tmp_path / "node-local"
    result = bench(
        tmp_path,
        "emergency",
        "--model-dir",
        str(hf_models["bert"]),
        "--reps",
        "1",
        "--node-local-dir",
        str(node_local),
    )
    variants = result["models"]["bert"]["variants"]
    assert set(variants) == {
        f"{s}/{v}" for s in ("disk", "slow") for v in ("durable only", "node-local copy")
    }
    for figures in variants.values():
        assert set(figures) == {
            "periodic",
            "safe_after",
            "emergency_durable",
            "load",
            "restart_to_first_step",
        }
        assert all(positive(stat) for stat in figures.values())
        assert figures["safe_after"]["median"] <= figures["emergency_durable"]["median"]
    assert not node_local.exists() or not any(node_local.iterdir())


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["emergency", "--storage", "tape"],
        ["emergency", "--slow-mbs", "0"],
        ["nosuch"],
        ["throughput", "--reps", "0"],
        ["overhead", "--sides", "product"],
        ["overhead", "--sides", "product,nosuch"],
        ["overhead", "--sides", "product,product"],
        ["scaling", "--world-sizes", "one"],
        ["checkpoint", "--models", "huge"],
        ["checkpoint", "--model-dir", "/nonexistent/model"],
        ["probe"],
        ["probe", "--model-dir", "/nonexistent/model"],
        ["resume", "--positions", "100"],
        ["drift", "--resize", "2to3"],
        ["drift", "--config", "tiny", "model.nosuch=1"],
        ["throughput", "--config", "tiny", "train.nosuch=1"],
        ["compile", "--config", "tiny", "train.compile=true"],
    ],
)
def test_bad_arguments_are_one_line_and_exit_2(argv: list[str], capsys: pytest.CaptureFixture) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err and len(err.splitlines()) == 1, err


def test_prepare(tmp_path: Path) -> None:
    result = bench(
        tmp_path, "prepare", "--config", "tiny", "--sizes", "300", "--workers", "1,2", "--start-reps", "1"
    )
    size = result["sizes"]["300"]
    assert sorted(size["workers"]) == ["1", "2"] and positive(size["parallel_ceiling"])
    assert size["questions"] == 300 and size["file_bytes"] > 0 and positive(size["first_step_s"])
    assert 0 < size["train_start_s"]["median"] <= size["first_step_s"]["median"]
    for figures in size["workers"].values():
        assert positive(figures["seconds"]) and positive(figures["peak_rss_bytes"])
        assert figures["cache_bytes"] > 0 and figures["questions_per_s"] > 0


def test_resume_reps_each_start_their_own_run_from_the_moved_copy(tmp_path: Path, cache_dir: Path) -> None:
    """Every rep is a new run.dir: it starts from the copy (checkpoint.resume_from), never claims it."""
    result = bench(
        tmp_path,
        "resume",
        "--config",
        "tiny",
        "--reps",
        "2",
        "--positions",
        "50",
        f"data.cache_dir={cache_dir}",
    )
    assert len(result["positions"]["50%"]["first_step_s"]["values"]) == 2


@pytest.mark.parametrize("target", ["worker", "node"])
def test_replicas_kills_each_group_once_and_the_ledger_holds(
    tmp_path: Path, cache_dir: Path, target: str
) -> None:
    pytest.importorskip("torchft")
    argv = ("replicas", "--faults", "2", "--target", target, "--config", "tiny")
    result = bench(tmp_path, *argv, f"data.cache_dir={cache_dir}")
    assert result["target"] == target and result["faults"] == 2 and len(result["per_fault"]) == 2
    if target == "node":  # the launcher started each group again once: a new torchrun agent
        records = [
            json.loads(line) for line in (tmp_path / "work" / "run" / "agents" / "replicas.jsonl").open()
        ]
        assert sorted(r["group"] for r in records if r["event"] == "group_started") == [0, 0, 1, 1]
    for name in ("survivor_s", "heal_s", "rejoin_s"):
        assert positive(result[name])
    for fault in result["per_fault"]:  # the survivors step before the killed group is back
        assert fault["survivor_s"] < fault["rejoin_s"] and fault["heal_s"] <= fault["rejoin_s"]
    assert result["ledger"] == {
        "ok": True,
        "retried_steps": result["ledger"]["retried_steps"],
        "discarded_steps": 0,  # no split: every committed step is the final model's
        "lineages": result["ledger"]["lineages"],
        "problems": [],
    }
    assert result["ledger"]["lineages"] >= 3  # the first, then one per quorum change (at least one a kill)
    assert result["committed_steps"] > 2 * 10


def test_replicas_with_the_lighthouse_killed_twice(tmp_path: Path, cache_dir: Path) -> None:
    pytest.importorskip("torchft")
    argv = ("replicas", "--faults", "2", "--target", "lighthouse", "--config", "tiny")
    result = bench(tmp_path, *argv, f"data.cache_dir={cache_dir}")
    assert result["target"] == "lighthouse" and result["faults"] == 2 and "heal_s" not in result
    for name in ("survivor_s", "restart_s", "rejoin_s"):
        assert positive(result[name])
    for fault in result["per_fault"]:
        assert fault["restart_s"] <= fault["rejoin_s"]
    assert result["ledger"]["ok"] and result["ledger"]["problems"] == []


def test_denormals_steps_both_copies_alike_and_the_rare_rows_moments_decay_into_denormals(
    tmp_path: Path,
) -> None:
    result = bench(
        tmp_path, "denormals", "--vocab", "1024", "--dim", "16", "--steps", "900", "--window", "300"
    )
    assert [w["steps"] for w in result["windows"]] == ["1-300", "301-600", "601-900"]
    assert all(w["off_ms"] > 0 and w["on_ms"] > 0 for w in result["windows"])
    # After ~740 steps without a gradient, the rare rows' first moments are denormal in the unflushed copy;
    # the flushed copy's are zero, and neither moment moves a float32 weight.
    assert result["denormals_at_end"] > 0 and result["weights_equal"] is True
