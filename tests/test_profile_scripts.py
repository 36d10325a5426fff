"""Scripts under profiles/ that read committed results: the kernel breakdown of a node-level nsys
export, the README's result tables; the fast probe's names, gpu_run.sh's parts and its failures."""
from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

from gdtool.measure import nsys

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "profiles"))

import fast_probe  # noqa: E402
import kernel_breakdown  # noqa: E402
import kernel_paths  # noqa: E402
import results_tables  # noqa: E402

NODE_EXPORT = ROOT / "tests" / "data" / "tiny-llama_b4_step-graph_node_noeos.sqlite.gz"


@pytest.mark.parametrize("name, cls", [
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "matmul"), ("splitKreduce_kernel", "matmul"),
    ("gemmk1_kernel", "matmul"), ("cudnn_generated_fort_native_sdpa_sm90_flash_fprop", "attention"),
    ("triton_red_fused__to_copy_argmax_0", "triton"), ("vectorized_elementwise_kernel", "other")])
def test_kernel_classes(name, cls):
    assert kernel_breakdown.kernel_class(name) == cls


def test_breakdown_adds_up_to_the_readers_busy_time():
    """The kernels joined to the last decode's graph launches are exactly the busy time gdtool.measure.nsys.read
    gives that decode's steps."""
    kernels, launches = kernel_breakdown.launch_kernels(NODE_EXPORT)
    steps = nsys.read(NODE_EXPORT)
    last = steps[steps["decode"] == steps["decode"].max()]
    assert launches == len(last) == 32
    assert kernels["us"].sum() == pytest.approx(last["device_busy_us"].sum())
    text = kernel_breakdown.breakdown(NODE_EXPORT)
    per_launch = kernels["us"].sum() / launches
    assert f"GPU busy {per_launch:.1f} µs per launch" in text and "| matmul |" in text


def test_breakdown_own_times_sum_to_the_union_of_overlapping_kernels():
    """Under PDL a kernel starts (and waits) while the one before runs: its 'own' time starts where every kernel
    before it in the launch has ended, so per launch the own times sum to the union of the kernels' intervals
    (merged here independently), none above its duration; the breakdown says the durations overlap."""
    export = ROOT / "profiles" / "h200" / "nsys-fast" / "qwen3-30b-a3b-b1-0f91d78" / "fast" / \
        "qwen3-30b-a3b_b1_step-graph_node_noeos_kernelsfast.sqlite.gz"
    kernels, launches = kernel_breakdown.launch_kernels(export)
    assert (kernels["own_us"] <= kernels["us"] + 1e-9).all() and (kernels["own_us"] >= 0).all()
    for corr, group in list(kernels.groupby("corr"))[:5]:
        union, end = 0.0, None
        for start, stop in sorted(zip(group["start"], group["end"])):
            if end is None or start >= end:
                union += stop - start
                end = stop
            elif stop > end:
                union += stop - end
                end = stop
        assert group["own_us"].sum() == pytest.approx(union / 1e3)
    assert kernels["us"].sum() > 1.3 * kernels["own_us"].sum()   # this step overlaps: PDL on
    assert "Kernels overlap (PDL" in kernel_breakdown.breakdown(export)
    assert "Kernels overlap" not in kernel_breakdown.breakdown(NODE_EXPORT)


def test_attention_is_split_by_the_kind_of_layer_it_served():
    """Kernel i of a launch's attention kernels serves layer i // (count / layers); a count that is not a multiple
    of the layers, or that differs between launches, is not assigned."""
    import pandas as pd

    types = ["sliding_attention", "full_attention", "sliding_attention"]
    rows = []
    for corr in (1, 2):
        for i in range(6):   # two kernels a layer: split, combine
            rows.append(dict(corr=corr, start=10 * i, own_us=float(1 + (i // 2 == 1) * 9), **{"class": "attention"}))
        rows.append(dict(corr=corr, start=100, own_us=50.0, **{"class": "matmul"}))
    kernels = pd.DataFrame(rows).sample(frac=1, random_state=0)   # the order comes from the start times
    table = kernel_breakdown.attention_by_layer_type(kernels, 2, types)
    assert table.loc["full_attention", "own"] == 20 and table.loc["sliding_attention", "own"] == 4
    assert table.loc["sliding_attention", "layers"] == 2 and table.loc["sliding_attention", "per_layer"] == 2
    assert kernel_breakdown.attention_by_layer_type(kernels[kernels["start"] != 0], 2, types) is None
    assert kernel_breakdown.attention_by_layer_type(kernels[(kernels["start"] != 0) | (kernels["corr"] == 1)], 2,
                                                    types) is None


def test_experts_kernels_bandwidth_counts_the_experts_a_batch_hits():
    """Each experts kernel's bytes per call are its stacked tensor's share that a step of B tokens hits on average,
    E * (1 - (1 - k/E)^B) of E experts (qwen3-30b-a3b: k = 8 of 128), over its own time per call; kernels that read
    no expert tensor have no bytes; a dense preset has no table."""
    import pandas as pd

    rows = []
    for corr in (1, 2):   # two launches of two layers: router, gate/up, down
        for layer in range(2):
            for name, own in (("_router_kernel", 2.0), ("_gate_up_kernel", 30.0), ("_down_kernel", 10.0)):
                rows.append(dict(corr=corr, name=name, us=own + 1, own_us=own, **{"class": "experts"}))
        rows.append(dict(corr=corr, name="nvjet_x", us=5.0, own_us=5.0, **{"class": "matmul"}))
    kernels = pd.DataFrame(rows)
    gate_up, down = 128 * 1536 * 2048 * 2, 128 * 2048 * 768 * 2   # bf16 bytes of the stacked tensors
    for batch in (1, 4, 64):
        hit = 1 - (1 - 8 / 128) ** batch
        table = kernel_breakdown.experts_by_kernel(kernels, 2, "qwen3-30b-a3b", batch)
        assert list(table.index) == ["_gate_up_kernel", "_down_kernel", "_router_kernel"]
        assert (table["calls"] == 2).all() and table.loc["_gate_up_kernel", "us_per_call"] == 30.0
        assert table.loc["_gate_up_kernel", "mb_per_call"] == pytest.approx(gate_up * hit / 1e6)
        assert table.loc["_down_kernel", "tb_s"] == pytest.approx(down * hit / 10e-6 / 1e12)
        assert pd.isna(table.loc["_router_kernel", "mb_per_call"])
    assert kernel_breakdown.experts_by_kernel(kernels, 2, "llama-1b", 1) is None
    assert kernel_breakdown.experts_by_kernel(kernels[kernels["class"] != "experts"], 2, "qwen3-30b-a3b", 1) is None


def test_the_gemma_breakdown_says_what_its_sliding_and_full_layers_cost():
    """Gemma 3's fast step at cb883e2 (prompt 128): 22 sliding and 4 full layers, two attention kernels each."""
    export = ROOT / "profiles" / "h200" / "nsys-gemma-fast-cb883e2" / "fast" / \
        "gemma-3-1b_b1_step-graph_node_noeos_kernelsfast.sqlite.gz"
    text = kernel_breakdown.breakdown(export, "gemma-3-1b")
    assert "| full_attention | 4 |" in text and "| sliding_attention | 22 |" in text


@pytest.mark.parametrize("model", ["llama-1b", "gemma-3-1b", "qwen3-8b"])
def test_the_fast_calls_read_every_linear_weight_once(model):
    """The fast products' calls (one qkv_rope a layer; o, gate/up and down a layer; the lm_head) read the preset's
    linear weights, each once: their bytes sum to the matmul class's count."""
    calls = kernel_breakdown.fast_calls(model)
    layers = len(kernel_breakdown._meta_model(model).model.layers)
    assert len(calls["_qkv_rope_gemv_kernel"]) == layers and len(calls["_rms_gemv_kernel"]) == 3 * layers + 1
    assert [r for r, _ in calls["_rms_gemv_kernel"][:4]] == ["o", "gate/up", "down", "o"]
    assert calls["_rms_gemv_kernel"][-1][0] == "lm_head"
    assert sum(b for plan in calls.values() for _, b in plan) == kernel_breakdown.linear_weight_bytes(model)


def test_attention_bytes_read_the_live_cache_and_a_sliding_layer_at_most_its_window():
    """Step j of a decode after a P-token prompt reads P + j slots of K and V a layer (bf16), a sliding layer at most
    its window: llama-1b's 16 layers x 8 heads x 64 at the mean P + N/2; Gemma 3's 22 sliding layers at 512 once
    the prompt fills the window, its 4 full ones past it."""
    llama = kernel_breakdown.attention_bytes("llama-1b", 2, 100, 48)
    assert llama == {"full_attention": pytest.approx(16 * 2 * 8 * 64 * (100 + 24) * 2 * 2)}
    from gdtool.measure.roofline import step_bytes
    assert llama["full_attention"] == pytest.approx(step_bytes(kernel_breakdown._meta_model("llama-1b"), 2, 100,
                                                               48)["kv_bytes"], rel=1e-6)
    gemma = kernel_breakdown.attention_bytes("gemma-3-1b", 1, 1024, 48)
    per_slot = 2 * 1 * 256 * 2
    assert gemma["sliding_attention"] == pytest.approx(22 * per_slot * 512)
    assert gemma["full_attention"] == pytest.approx(4 * per_slot * (1024 + 24))
    short = kernel_breakdown.attention_bytes("gemma-3-1b", 1, 8, 48)   # windows not yet full: as full layers
    assert short["sliding_attention"] / 22 == pytest.approx(short["full_attention"] / 4)


def _fast_launches(model: str, launches: int, rms_calls: int | None = None):
    """Synthetic node-trace kernels of `launches` fast steps: per layer qkv_rope (3 µs), two attention kernels
    (1 µs each), the rms_gemv calls (2 µs each, the lm_head 10), and one other kernel (0.5 µs)."""
    import pandas as pd
    layers = len(kernel_breakdown._meta_model(model).model.layers)
    rows = []
    for corr in range(launches):
        t = 0
        rms = iter(kernel_breakdown.fast_calls(model)["_rms_gemv_kernel"])
        for _ in range(layers):
            names = [("_qkv_rope_gemv_kernel", "matmul", 3.0), ("_attention_split_kernel", "attention", 1.0),
                     ("_attention_combine_kernel", "attention", 1.0)]
            names += [("_rms_gemv_kernel", "matmul", 2.0)] * (3 if rms_calls is None else rms_calls)
            for name, cls, own in names:
                if name == "_rms_gemv_kernel":
                    next(rms)
                rows.append(dict(corr=corr, start=t, name=name, us=own, own_us=own, **{"class": cls}))
                t += 10
        rows.append(dict(corr=corr, start=t, name="_rms_gemv_kernel", us=10.0, own_us=10.0, **{"class": "matmul"}))
        rows.append(dict(corr=corr, start=t + 10, name="_argmax_blocks", us=0.5, own_us=0.5, **{"class": "other"}))
    return pd.DataFrame(rows).sample(frac=1, random_state=1)   # the order comes from the start times


def test_each_kernel_is_held_to_its_own_floor():
    """Each call is matched to the weight it reads by its place in the launch; a role's floor is its bytes over the
    copy bandwidth, 'over' its own time less that; attention is split by the kind of layer (Gemma 3) with the live
    cache for its bytes; a kernel reading no weights has no floor; the table sums to the step."""
    kernels = _fast_launches("gemma-3-1b", 3)
    table = kernel_breakdown.floor_account(kernels, 3, "gemma-3-1b", 1, 2000.0, prompt_len=1024)
    calls = kernel_breakdown.fast_calls("gemma-3-1b")
    assert table.loc["lm_head", "own"] == 10.0 and table.loc["lm_head", "calls"] == 1
    assert table.loc["lm_head", "mb"] == pytest.approx(calls["_rms_gemv_kernel"][-1][1] / 1e6)
    assert table.loc["gate/up", "calls"] == 26 and table.loc["gate/up", "own"] == 52.0
    assert table.loc["gate/up", "floor"] == pytest.approx(table.loc["gate/up", "mb"] / 2000.0 * 1e3)
    assert table.loc["gate/up", "over"] == pytest.approx(52.0 - table.loc["gate/up", "floor"])
    kv = kernel_breakdown.attention_bytes("gemma-3-1b", 1, 1024, 48)
    assert table.loc["attention, sliding layers", "calls"] == 44
    assert table.loc["attention, sliding layers", "mb"] == pytest.approx(kv["sliding_attention"] / 1e6)
    assert table.loc["attention, full layers", "mb"] == pytest.approx(kv["full_attention"] / 1e6)
    assert pd_isna(table.loc["`_argmax_blocks`", "floor"]) and table.loc["`_argmax_blocks`", "over"] == 0.5
    assert table["own"].sum() == pytest.approx(kernels["own_us"].sum() / 3)
    assert table["mb"].sum() == pytest.approx(sum(b for p in calls.values() for _, b in p) / 1e6
                                              + sum(kv.values()) / 1e6)
    text = "\n".join(kernel_breakdown.floor_lines(table, 2000.0, 12))
    assert "| lm_head | 1 | 10.0 |" in text and "| `_argmax_blocks` | 1 | 0.5 | - |" in text and "more" not in text
    text = "\n".join(kernel_breakdown.floor_lines(table, 2000.0, 4))   # the rest in one row
    assert f"| {len(table) - 4} more, each under" in text and "lm_head" not in text
    # without the prompt's length the attention has no floor; calls that do not match the plan keep their name
    table = kernel_breakdown.floor_account(_fast_launches("llama-1b", 2, rms_calls=2), 2, "llama-1b", 1, 2000.0)
    assert pd_isna(table.loc["attention, full layers", "floor"])
    assert "lm_head" not in table.index and pd_isna(table.loc["`_rms_gemv_kernel`", "mb"])
    assert table.loc["q/k/v + RoPE", "calls"] == 16


def pd_isna(value) -> bool:
    import pandas as pd
    return bool(pd.isna(value))


def test_the_committed_llama_trace_is_held_to_its_floors(tmp_path, capsys):
    """llama-1b's fast step on the H200 (e4c1eba): every product and the attention get a floor, the products read
    all 2.47 GB of linear weights, and the command line prints the account."""
    export = ROOT / "profiles" / "h200" / "nsys-fast" / "llama-1b-b1-e4c1eba" / "fast" / \
        "llama-1b_b1_step-graph_node_noeos_kernelsfast.sqlite.gz"
    kernels, launches = kernel_breakdown.launch_kernels(export)
    table = kernel_breakdown.floor_account(kernels, launches, "llama-1b", 1, 4200.0, prompt_len=128)
    assert {"q/k/v + RoPE", "o", "gate/up", "down", "lm_head", "attention, full layers"} <= set(table.index)
    products = table.loc[["q/k/v + RoPE", "o", "gate/up", "down", "lm_head"], "mb"].sum()
    assert products == pytest.approx(kernel_breakdown.linear_weight_bytes("llama-1b") / 1e6)
    assert table["own"].sum() == pytest.approx(kernels["own_us"].sum() / launches)
    out = tmp_path / "b.md"
    assert kernel_breakdown.main([str(export), "--model", "llama-1b", "--copy-gb-s", "4200", "--prompt-len", "128",
                                  "--out", str(out)]) == 0
    assert "Each kernel against its own floor (its bytes over the copy bandwidth, 4200 GB/s)" in out.read_text()
    with pytest.raises(SystemExit):
        kernel_breakdown.main([str(export), "--copy-gb-s", "4200"])
    assert "--copy-gb-s needs --model" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["llama-1b", "gemma-3-1b"])
def test_the_committed_64_row_traces_hold_cublas_products_to_their_floors(model):
    """At 64 rows the fast step runs the compiled HF forward (cuBLAS's products, fused q/k/v and gate/up): on the
    H100 traces (4bc4f5c) each product gets the weights it reads by its place in the launch, together all the linear
    weights; a split-K product's reduction counts with it (down: two kernels a layer); each attention kernel the
    kind of layer of the q/k/v product before it, the cache it reads summed per kind; inductor's norms named."""
    folder = ROOT / "profiles" / "h100" / "nsys-fast" / f"{model}-b64-fused-4bc4f5c" / "fast"
    kernels, launches = kernel_breakdown.launch_kernels(next(folder.glob("*.sqlite.gz")))
    table = kernel_breakdown.floor_account(kernels, launches, model, 64, 3000.0, prompt_len=128)
    roles = ["q/k/v", "o", "gate/up", "down", "lm_head"]
    assert set(roles) <= set(table.index)
    assert table.loc[roles, "mb"].sum() == pytest.approx(kernel_breakdown.linear_weight_bytes(model) / 1e6)
    layers = len(kernel_breakdown._meta_model(model).model.layers)
    assert table.loc[["q/k/v", "o", "gate/up"], "calls"].tolist() == [layers] * 3
    assert table.loc["down", "calls"] == 2 * layers and table.loc["lm_head", "calls"] == 1   # down: split-K
    assert not any("splitKreduce" in str(role) or "nvjet" in str(role) for role in table.index)
    kinds = {f"attention, {k.replace('_attention', '')} layers": v
             for k, v in kernel_breakdown.attention_bytes(model, 64, 128, 48).items()}
    assert set(kinds) <= set(table.index)
    for role, nbytes in kinds.items():
        assert table.loc[role, "mb"] == pytest.approx(nbytes / 1e6)
    assert "RMSNorm (inductor)" in table.index
    assert table["own"].sum() == pytest.approx(kernels["own_us"].sum() / launches)


def test_compiled_calls_and_inductor_roles():
    fused, apart = (kernel_breakdown.compiled_calls("llama-1b", f) for f in (True, False))
    assert len(fused) == 4 * 16 + 1 and len(apart) == 7 * 16 + 1
    assert sum(b for _, b in fused) == sum(b for _, b in apart) == kernel_breakdown.linear_weight_bytes("llama-1b")
    assert [r for r, _ in apart[:7]] == ["q", "k", "v", "o", "gate", "up", "down"]
    assert kernel_breakdown.inductor_role("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3") == "RMSNorm (inductor)"
    assert kernel_breakdown.inductor_role("triton_poi_fused_mul_silu_7") == "activation x up (inductor)"
    assert kernel_breakdown.inductor_role("_attention_split_kernel") is None


def test_trace_folder_names_say_preset_batch_prompt_and_commit():
    assert kernel_breakdown.trace_folder("profiles/h200/nsys-fast/gemma-3-1b-b1-p4096-a7748ba") == \
        ("gemma-3-1b", 1, 4096, "a7748ba")
    assert kernel_breakdown.trace_folder("qwen3-30b-a3b-b64-41fab16") == ("qwen3-30b-a3b", 64, 128, "41fab16")
    assert kernel_breakdown.trace_folder("llama-1b-b64-fused-d51af73") == ("llama-1b", 64, 128, "d51af73")
    assert kernel_breakdown.trace_folder("gemma-3-1b-b64-p1024-fused-d51af73") == ("gemma-3-1b", 64, 1024, "d51af73")
    with pytest.raises(ValueError, match="not an nsys-fast folder's name"):
        kernel_breakdown.trace_folder("nsys-gemma-fast-cb883e2")


def test_a_trace_is_held_to_the_copy_bandwidth_measured_beside_it_else_its_bench_runs(tmp_path):
    import json
    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps({"environment": {"copy_gb_s": 4100.5}}))
    assert kernel_breakdown.trace_copy_gb_s(tmp_path, bench) == (4100.5, str(bench))
    with pytest.raises(ValueError, match="no copy_gb_s.txt beside the trace; name a bench run"):
        kernel_breakdown.trace_copy_gb_s(tmp_path)
    (tmp_path / "copy_gb_s.txt").write_text("3010.2\n")   # nsys-fast's, measured in the same part: it wins
    assert kernel_breakdown.trace_copy_gb_s(tmp_path, bench) == (3010.2, None)


def test_breakdown_refuses_a_graph_level_trace():
    graph_level = ROOT / "profiles" / "h200" / "nsys-compiled" / "llama-1b_b1_step-graph_graph_noeos_kernelscompiled.sqlite.gz"
    with pytest.raises(ValueError, match="--cuda-graph-trace=node"):
        kernel_breakdown.launch_kernels(graph_level)


def test_results_tables_render_from_committed_files(capsys):
    assert results_tables.main([]) == 0
    text = capsys.readouterr().out
    for name in results_tables.TABLES:
        assert f"### {name}" in text
    assert "| 1 | 3 |" in text  # device-loop host time: batch 1, three runs
    with pytest.raises(SystemExit, match="unknown table"):
        results_tables.main(["nope"])


@pytest.mark.parametrize("argv, flag", [(["--select-variants", "greedy,nope"], "--select-variants"),
                                        (["--cases", "sampel"], "--cases"),
                                        (["--decode-kernels", "fused"], "--decode-kernels")])
def test_fast_probe_refuses_unknown_names(argv, flag, capsys):
    with pytest.raises(SystemExit):
        fast_probe.parse_args(argv)
    err = capsys.readouterr().err
    assert flag in err and "choose from" in err


def test_fast_probe_names_match_its_parts():
    args = fast_probe.parse_args(["--select-variants", "part-topk-unsorted", "--cases", "greedy,sample"])
    assert args.select_variants == ["part-topk-unsorted"] and args.cases == ["greedy", "sample"]


def _gpu_run(tmp_path, *parts, **env_vars):
    import os
    import subprocess
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])), **env_vars}
    done = subprocess.run(["bash", str(ROOT / "profiles" / "gpu_run.sh"), str(tmp_path / "out"), *parts], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=300)
    return done.returncode, (tmp_path / "out" / "log").read_text()


def test_gpu_run_exits_nonzero_when_a_part_fails(tmp_path):
    """A part that fails (the fast probe refuses a machine without a GPU) or is not a part makes the whole
    run exit 1, after the other parts ran, and the log names them; the environment sidecar is kept."""
    rc, log = _gpu_run(tmp_path, "fast", "no-such-part")
    assert rc == 1, log
    assert "=== fast exit 1" in log and "unknown part no-such-part" in log
    assert "=== failed: fast no-such-part" in log
    import tarfile
    with tarfile.open(tmp_path / "out" / "results.tar") as tar:
        names = tar.getnames()
    assert "env.json" in names and "fast/log" in names
    rc, log = _gpu_run(tmp_path)
    assert rc == 0 and "every part passed" in log


def test_gpu_run_tuning_check_needs_a_gpu_and_a_sweep(tmp_path, capsys):
    """tuning-check reads the GPU's own file: on a machine without one it fails and says so; a check with no sweep
    given (no kernels-sweep or moe-sweep earlier in the run) fails rather than passing nothing."""
    rc, log = _gpu_run(tmp_path, "tuning-check")
    assert rc == 1 and "=== tuning-check exit 2" in log
    assert "--config device: the file of this machine's CUDA GPU, and it has none" in \
        (tmp_path / "out" / "log").read_text() + _part_log(tmp_path, "tuning-check")
    import tuning_files
    from gdtool.kernels import tuning
    assert tuning_files.main(["--config", str(ROOT / "gdtool" / "kernels" / "configs" / tuning.DEFAULTS)]) == 1
    assert "0 of 0 within 3%" in capsys.readouterr().out


def test_gpu_run_bench_peers_runs_the_peers_tables_missing_runs_of_the_models_asked(tmp_path):
    """bench-peers writes the commands doc_tables.py --rerun gives for the models and batch asked (BENCH_PEERS in
    place of none), under this run's folder and the names the table reads; a model with none missing fails, saying
    so, rather than passing having run nothing."""
    rc, log = _gpu_run(tmp_path, "bench-peers", BENCH_MODELS="no-such-preset")
    assert rc == 1 and "no run of BENCH_MODELS is missing" in _part_log(tmp_path, "bench-peers")
    import doc_tables
    wanted = [line for line in doc_tables.rerun("h100") if "--model qwen3-30b-a3b --batch 1 " in line]
    if not wanted:
        pytest.skip("profiles/h100/bench/ holds qwen3-30b-a3b's batch-1 run: nothing to rerun")
    import tarfile
    env = dict(BENCH_MODELS="qwen3-30b-a3b", BENCH_BATCH="1", BENCH_PEERS="generate-static", GPU_RUN_SECONDS="60")
    rc, log = _gpu_run(tmp_path, "bench-peers", **env)
    with tarfile.open(tmp_path / "out" / "results.tar") as tar:
        commands = tar.extractfile("bench-peers/commands.txt").read().decode().splitlines()
    assert rc == 1 and "no CUDA GPU is here" in _part_log(tmp_path, "bench-peers")   # written, not run on a CPU
    assert len(commands) == 1
    assert "--model qwen3-30b-a3b --batch 1 " in commands[0] and "--peers generate-static" in commands[0]
    assert commands[0].endswith("bench-peers/h100/bench/qwen3-30b-a3b")


def test_gpu_run_nsys_fast_traces_each_model_asked_with_the_projections_fused_where_asked(tmp_path):
    """nsys-fast: one trace and breakdown per model of NSYS_MODEL (space-separated) and kernels of NSYS_KERNELS, in
    <model>-b<batch>[-fused]/<kernels>/, with `fuse_projections` set where NSYS_FUSED is (the bench's batch-64 runs).
    A stand-in interpreter records the commands (and makes the folders the profile would): the part's own logic, not
    a GPU's trace."""
    import stat
    calls = tmp_path / "calls.txt"
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/sh
case "$*" in *gdtool.measure.record*) exec {sys.executable} "$@";; esac
echo "$*" >> {calls}
prev=; for a in "$@"; do [ "$prev" = --out ] && mkdir -p "$a"; prev=$a; done
echo 3000.0
""")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    rc, log = _gpu_run(tmp_path, "nsys-fast", PYTHON=str(stub), NSYS_MODEL="llama-1b gemma-3-1b", NSYS_BATCH="64",
                       NSYS_FUSED="1", NSYS_KERNELS="fast")
    assert rc == 0, log
    lines = calls.read_text().splitlines()
    profiles = [line for line in lines if line.startswith("-m gdtool profile")]
    breakdowns = [line for line in lines if "kernel_breakdown.py" in line]
    assert [p.split("--model ")[1].split()[0] for p in profiles] == ["llama-1b", "gemma-3-1b"]
    assert all("--batch 64 " in p and "--set kernels=fast --set fuse_projections=true" in p for p in profiles)
    assert "/nsys-fast/llama-1b-b64-fused/fast" in profiles[0] and "/nsys-fast/gemma-3-1b-b64-fused/fast" in profiles[1]
    assert len(breakdowns) == 2 and "--copy-gb-s 3000.0" in breakdowns[0]
    calls.unlink()
    rc, log = _gpu_run(tmp_path / "plain", "nsys-fast", PYTHON=str(stub), NSYS_KERNELS="fast")
    profiles = [line for line in calls.read_text().splitlines() if line.startswith("-m gdtool profile")]
    assert rc == 0 and len(profiles) == 1 and "fuse_projections" not in profiles[0]
    assert "--model gemma-3-1b --batch 1 " in profiles[0] and "/nsys-fast/gemma-3-1b-b1/fast" in profiles[0]


def test_gpu_run_bench_peers_takes_its_folder_from_the_gpus_name(tmp_path):
    """bench-peers on an H200 (a stand-in interpreter answers the part's question of the GPU's name): the commands go
    under bench-peers/h200/, every run of the table with BENCH_AGAIN=1; a BENCH_GPU naming the other GPU is refused,
    saying so, before any command is written."""
    import stat
    import tarfile
    stub = tmp_path / "python"
    stub.write_text(f"""#!/bin/sh
case "$*" in *get_device_name*) echo h200; exit 0;; esac
exec {sys.executable} "$@"
""")
    stub.chmod(stub.stat().st_mode | stat.S_IEXEC)
    rc, log = _gpu_run(tmp_path / "wrong", "bench-peers", PYTHON=str(stub), BENCH_GPU="h100")
    assert rc == 1 and "this GPU is an h200, and BENCH_GPU names h100: leave it out" in \
        _part_log(tmp_path / "wrong", "bench-peers")
    with tarfile.open(tmp_path / "wrong" / "out" / "results.tar") as tar:
        assert "bench-peers/commands.txt" not in tar.getnames()
    rc, log = _gpu_run(tmp_path, "bench-peers", PYTHON=str(stub), BENCH_AGAIN="1", BENCH_MODELS="llama-1b|qwen3-8b")
    with tarfile.open(tmp_path / "out" / "results.tar") as tar:
        commands = tar.extractfile("bench-peers/commands.txt").read().decode().splitlines()
    assert rc == 1 and "no CUDA GPU is here" in _part_log(tmp_path, "bench-peers")   # written, not run on a CPU
    assert len(commands) == 4 and all("/bench-peers/h200/bench/" in c for c in commands), commands


def _part_log(tmp_path, part: str) -> str:
    """A part's own log, from the results tar gpu_run.sh writes."""
    import tarfile
    with tarfile.open(tmp_path / "out" / "results.tar") as tar:
        return tar.extractfile(f"{part}/log").read().decode()


def test_gpu_run_cuts_its_parts_to_the_whole_runs_limit(tmp_path):
    """GPU_RUN_SECONDS: each part gets the time left less a margin, and one with no time left is named, not begun
    (a run cut from outside loses the part it cut, files and all)."""
    rc, log = _gpu_run(tmp_path, "fast", GPU_RUN_SECONDS="100")
    import re
    limit = int(re.search(r"=== fast \(\d\d:\d\d:\d\d, at most (\d+) s\)", log).group(1))
    assert 50 <= limit <= 80, log  # 100 s, less the margin and the seconds the environment sidecar took
    rc, log = _gpu_run(tmp_path / "again", "fast", GPU_RUN_SECONDS="25")
    assert rc == 1 and "=== fast: not run, 25 s run limit reached" in log and "=== failed: fast" in log


def test_gpu_run_deadline_cuts_parts_across_runs_that_share_a_folder(tmp_path):
    """GPU_RUN_DEADLINE (Unix seconds): one end for several runs of the script in one command, each part cut to
    it less the margin; runs sharing OUT_DIR append to its log and results.tar."""
    import re
    import tarfile
    import time
    rc, log = _gpu_run(tmp_path, "fast", GPU_RUN_DEADLINE=str(int(time.time()) + 100))
    limit = int(re.search(r"=== fast \(\d\d:\d\d:\d\d, at most (\d+) s\)", log).group(1))
    assert 50 <= limit <= 80, log
    rc, log = _gpu_run(tmp_path, "fast", GPU_RUN_DEADLINE=str(int(time.time()) + 25))
    assert rc == 1 and "=== fast: not run, GPU_RUN_DEADLINE reached" in log, log
    assert log.count("=== fast (") == 1 and log.count("=== fast: not run") == 1  # both runs in one log
    with tarfile.open(tmp_path / "out" / "results.tar") as tar:
        assert tar.getnames().count("fast/log") == 1 and tar.getnames().count("env.json") == 2
    rc, log = _gpu_run(tmp_path / "again", "fast", GPU_RUN_SECONDS="100", GPU_RUN_DEADLINE=str(int(time.time()) + 25))
    assert rc == 1 and "=== fast: not run, GPU_RUN_DEADLINE reached" in log, log  # the earlier of the two


def test_gpu_run_refuses_a_run_limit_that_is_not_whole_seconds(tmp_path):
    import os
    import subprocess
    done = subprocess.run(["bash", str(ROOT / "profiles" / "gpu_run.sh"), str(tmp_path / "out"), "fast"], cwd=ROOT,
                          env=dict(os.environ, GPU_RUN_SECONDS="9m"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "GPU_RUN_SECONDS=9m: give the whole run's limit in whole seconds" in done.stderr
    done = subprocess.run(["bash", str(ROOT / "profiles" / "gpu_run.sh"), str(tmp_path / "out"), "fast"], cwd=ROOT,
                          env=dict(os.environ, GPU_RUN_DEADLINE="+540"), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "GPU_RUN_DEADLINE=+540: give the end of the whole command as Unix seconds" \
        in done.stderr


def test_agreement_table_from_the_committed_profile_and_sessions(capsys):
    import agreement
    h200 = ROOT / "profiles" / "h200"
    argv = ["--profile", str(h200 / "profile" / "summary.csv"), "--nsys",
            *(str(h200 / d / "summary.csv") for d in ("nsys-graph", "nsys-node1", "nsys-node16"))]
    assert agreement.main(argv) == 0
    text = capsys.readouterr().out
    table = agreement.tables(argv[1], argv[3:]).set_index(["mode", "batch"])
    assert set(table.index) == {(m, b) for m in ("eager", "forward-graph", "step-graph") for b in (1, 16)}
    assert table.loc[("step-graph", 16), "busy_trace"] == "node" and table.loc[("eager", 1), "busy_trace"] == "graph"
    for mode in ("forward-graph", "step-graph"):   # the same kernels timed twice: within 1%
        assert (table.loc[mode, "busy_ratio"] - 1).abs().max() < 0.01
    assert "| step-graph | 16 |" in text and "within 10% of nsys for" in text
    with pytest.raises(SystemExit, match="the nsys table lacks \\['trace'\\]"):
        agreement.main(["--profile", str(h200 / "profile" / "summary.csv"), "--nsys",
                        str(ROOT / "profiles" / "sweeps" / "llama-1b_geom128.csv")])


def test_gpu_run_parts_are_those_the_readme_names():
    """Every part of gpu_run.sh makes files that profiles/README.md names, and every part the README's
    table of parts names is one gpu_run.sh runs."""
    import re
    script = (ROOT / "profiles" / "gpu_run.sh").read_text()
    parts = set(re.findall(r"^    ([a-z0-9-]+)\) part ", script, flags=re.M))
    readme = (ROOT / "profiles" / "README.md").read_text()
    table = readme[readme.index("| committed | part (`gpu_run.sh OUT PART`)"):readme.index("Some committed files came")]
    cells = re.findall(r"^\| [^|]+ \| ([^|]+) \|", table, flags=re.M)
    named = {part for cell in cells for part in re.findall(r"`([a-z0-9-]+)`", cell)}
    assert parts == named, (sorted(parts - named), sorted(named - parts))


def test_kernel_paths_passes_a_path_only_where_every_test_that_ran_it_passed(tmp_path, capsys):
    import json
    lines = [json.dumps(r) for r in (
        {"test": "a", "outcome": "passed", "paths": ["Llama, <= 4 rows", "Qwen3, q/k norm, <= 4 rows"]},
        {"test": "b", "outcome": "failed", "paths": ["Qwen3, q/k norm, <= 4 rows"]},
        {"test": "c", "outcome": "skipped", "paths": ["qwen3_moe experts"]},
        {"test": "d", "outcome": "passed", "paths": []},
        {"test": "e", "outcome": "failed", "paths": [], "why": "E   assert False\ntests/x.py:3: AssertionError"})]
    passed, failing = kernel_paths.read(lines)
    assert passed == ["Llama, <= 4 rows"] and failing == {"Qwen3, q/k norm, <= 4 rows": ["b"]}
    f = tmp_path / "paths.jsonl"
    f.write_text("\n".join(lines) + "\n")
    assert kernel_paths.main([str(f)]) == 1
    out = capsys.readouterr().out
    assert "'Llama, <= 4 rows'," in out and "FAILED 'Qwen3, q/k norm, <= 4 rows': b" in out
    # every failed test with its reason, one that ran no kernel path too (an older file's line has none)
    assert kernel_paths.failed_tests(lines) == {"b": "", "e": "E   assert False\ntests/x.py:3: AssertionError"}
    assert "FAILED e\n    E   assert False\n    tests/x.py:3: AssertionError" in out
    assert "FAILED b\n    (no reason recorded)" in out
    assert kernel_paths.main([str(tmp_path / "missing.jsonl")]) == 2   # no CUDA: the tests skipped, wrote nothing
    assert "missing.jsonl: no such file" in capsys.readouterr().err


def test_a_failed_tests_reason_is_the_last_lines_of_its_report():
    """tests/conftest.py keeps a failed cuda test's reason in the GDTOOL_KERNEL_PATHS line: its report's last
    non-blank lines (the assertion and where it was raised), capped in length."""
    sys.path.insert(0, str(ROOT / "tests"))
    import conftest
    text = "\n".join(f"line {i}" for i in range(30)) + "\n\nE   assert 1 == 2\n\n"
    assert conftest.failure_lines(text).splitlines() == [f"line {i}" for i in range(19, 30)] + ["E   assert 1 == 2"]
    assert conftest.failure_lines("x" * 9000) == "x" * 4000


def test_zoo_table_renders_a_gpu_runs_outcomes_as_the_zoo_test_keeps_them(tmp_path, monkeypatch, capsys):
    """`ZOO_OUTCOMES=FILE pytest -m cuda tests/test_zoo.py` keeps one line per case (tests/zoo.py keep_outcome);
    zoo_table.py --cuda-outcomes renders the counts and every architecture refused in a mode, with the cause."""
    sys.path.insert(0, str(ROOT / "tests"))
    import zoo
    import zoo_table
    path = tmp_path / "outcomes.jsonl"
    refusal = "refused: capturing X's decode step failed: nonzero reads a device value on the host, at m.py:3"
    zoo.keep_outcome(str(path), "alpha", "cuda", {"status": "ran", "results": [
        ["greedy", "eager", 1, "pass"], ["greedy", "step-graph", 1, "pass"], ["sample", "step-graph", 4, "pass"]]})
    zoo.keep_outcome(str(path), "beta", "cuda", {"status": "ran", "results": [
        ["greedy", "eager", 1, "pass"], ["greedy", "step-graph", 1, refusal], ["sample", "step-graph", 4, refusal]]})
    zoo.keep_outcome(str(path), "aleph", "cuda", {"status": "ran", "results": [  # finished last, listed first
        ["greedy", "eager", 1, "pass"], ["greedy", "step-graph", 1, refusal]]})
    zoo.keep_outcome(str(path), "gamma", "cuda", {"status": "not built", "error": "ImportError: needs timm"})
    zoo.keep_outcome(str(path), "delta", "cuda", {"status": "crashed", "error": "exit -6: CUDA error"})
    zoo.keep_outcome(str(path), "alpha", "cpu", {"status": "ran", "results": []})  # a CPU line: not this section's
    text = zoo_table.render_cuda(path)
    assert "5 cases; 3 ran, 1 of them passing in every mode and 2 refused in a mode" in text
    assert "1 not in the zoo there" in text and "1 mismatched or crashed: delta (crashed)" in text
    row = next(line for line in text.splitlines() if line.startswith("| beta |"))
    assert row.split(" | ")[1] == "pass" and "nonzero reads a device value on the host, at m.py:3" in row
    assert "| alpha |" not in text
    assert [line.split(" | ")[0] for line in text.splitlines() if line.startswith("| ") and "---" not in line][1:] == \
        ["| aleph", "| beta"]  # by name, not by the order the workers finished in
    with pytest.raises(SystemExit):
        zoo_table.main(["--cuda-outcomes", str(tmp_path / "missing.jsonl"), "--out", str(tmp_path / "zoo.md")])
    assert "--cuda-outcomes" in capsys.readouterr().err


def test_plan_bench_passes_its_switches_to_the_bench_for_the_run_only(tmp_path, capsys):
    """plan_bench's switches (`triton.switches`, not patched module globals): the settings line says them, the bench
    in the same process runs them (with the embedding lookup apart its kernels note names no fold, with it folded it
    does), and after the run every switch is back to what it was."""
    import json
    import plan_bench
    from gdtool.kernels import gemv, triton as fast_triton
    before = {name: fast_triton.asked(name) for name in fast_triton.SWITCHES}
    notes = {}
    for fold in (0, 1):
        out = tmp_path / f"fold-{fold}"
        bench = ["--model", "tiny-llama", "--batch", "1", "--prompt-len", "4", "--max-new-tokens", "4", "--repeats",
                 "1", "--device", "cpu", "--modes", "step-graph", "--kernels", "fast", "--peers", "none",
                 "--out", str(out)]
        assert plan_bench.main(["--fused", "0", "--tail", "0", "--fold-embedding", str(fold), "--", *bench]) == 0
        said = capsys.readouterr().out
        assert "fused combine off" in said and "one-kernel tail off" in said, said
        assert ("embedding folded" if fold else "embedding apart") in said, said
        doc = json.loads(next(out.glob("*.json")).read_text())
        notes[fold] = " ".join(str(r.get("note")) for r in doc["summary"] if r["family"] == "gdtool")
    assert gemv.FOLD_EMBEDDING_PATH in notes[1] and gemv.FOLD_EMBEDDING_PATH not in notes[0], notes
    assert {name: fast_triton.asked(name) for name in fast_triton.SWITCHES} == before


def test_plan_bench_max_autotune_holds_for_the_bench_run_only(monkeypatch, capsys):
    """--max-autotune 1: gdtool's compiled programs compile under inductor's max-autotune while the bench runs (the
    options `step.inductor_options` adds, the others kept), and the options are as before once it returns, also when
    the bench raises; 0 leaves them as they are."""
    import plan_bench
    from gdtool.kernels import step
    before = dict(step.INDUCTOR_OPTIONS)
    seen = []

    def bench(argv):
        seen.append(dict(step.INDUCTOR_OPTIONS))
        if "--raise" in argv:
            raise RuntimeError("the bench failed")
        return 0
    monkeypatch.setattr(plan_bench.cli, "main", bench)
    assert plan_bench.main(["--max-autotune", "1", "--", "--model", "tiny-llama"]) == 0
    assert "max-autotune on" in capsys.readouterr().out
    assert seen[-1] == {**before, "max_autotune": True} and step.INDUCTOR_OPTIONS == before
    with pytest.raises(RuntimeError, match="the bench failed"):
        plan_bench.main(["--max-autotune", "1", "--", "--raise"])
    assert step.INDUCTOR_OPTIONS == before
    assert plan_bench.main(["--max-autotune", "0", "--"]) == 0 and seen[-1] == before
    assert "max-autotune off" in capsys.readouterr().out


def test_plan_bench_loop_elements_hold_for_the_bench_run_only(monkeypatch, capsys):
    """--loop-elements N: the bench runs under a tuning whose attention.loop_elements is N (the split loop's keys an
    iteration, `attention.loop_keys`), the settings line says it, and the tuning is as before once it returns; a
    count below 1 is refused with the reason. --sliding 0|1, --argmax 0|1 and --dot 0|1: the sliding_split,
    compiled_argmax and dot_linear switches for the run only."""
    import plan_bench
    from gdtool.kernels import attention, tuning
    before = tuning.current()["attention"]["loop_elements"]
    seen = []
    monkeypatch.setattr(plan_bench.cli, "main",
                        lambda argv: seen.append((tuning.current()["attention"]["loop_elements"],
                                                  attention.loop_keys(64))) or 0)
    assert plan_bench.main(["--loop-elements", "4096", "--", "--model", "tiny-llama"]) == 0
    assert seen == [(4096, 64)] and "loop elements 4096" in capsys.readouterr().out
    assert tuning.current()["attention"]["loop_elements"] == before
    with pytest.raises(SystemExit):
        plan_bench.main(["--loop-elements", "0", "--"])
    assert "--loop-elements 0: give a positive count" in capsys.readouterr().err
    from gdtool.kernels import triton as fast_triton
    monkeypatch.setattr(plan_bench.cli, "main", lambda argv: seen.append(fast_triton.asked("sliding_split")) or 0)
    for flag, said in (("0", "sliding layers HF sdpa"), ("1", "sliding layers split-KV")):
        assert plan_bench.main(["--sliding", flag, "--"]) == 0
        assert seen[-1] is (flag == "1") and said in capsys.readouterr().out
    assert fast_triton.asked("sliding_split") is True   # the default again (GDTOOL_SLIDING_SPLIT unset here)
    monkeypatch.setattr(plan_bench.cli, "main", lambda argv: seen.append(fast_triton.asked("compiled_argmax")) or 0)
    for flag, said in (("0", "compiled step's argmax inductor"), ("1", "compiled step's argmax two-stage")):
        assert plan_bench.main(["--argmax", flag, "--"]) == 0
        assert seen[-1] is (flag == "1") and said in capsys.readouterr().out
    assert fast_triton.asked("compiled_argmax") is True   # the default again (GDTOOL_COMPILED_ARGMAX unset here)
    monkeypatch.setattr(plan_bench.cli, "main", lambda argv: seen.append(fast_triton.asked("dot_linear")) or 0)
    for flag, said in (("1", "matrix-vector rows split-K dot"), ("0", "matrix-vector rows cuBLAS")):
        assert plan_bench.main(["--dot", flag, "--"]) == 0
        assert seen[-1] is (flag == "1") and said in capsys.readouterr().out
    assert fast_triton.asked("dot_linear") is False   # the default again (GDTOOL_DOT_LINEAR unset here)


def test_bench_fastest_compares_with_the_peers_of_the_same_run():
    """bench_table.fastest: gdtool's fastest runner per model and batch, beside the fastest peer of its own run
    (a faster peer measured in another run is not its ratio), with that run's floor and commit."""
    import pandas as pd
    import bench_table  # profiles/, on the path above
    rows = [("m", 1, "gdtool a", "gdtool", 2.0, 0.5, "c1", "old.json"), ("m", 1, "peer p", "peer", 1.5, 0.5, "c1", "old.json"),
            ("m", 1, "gdtool b", "gdtool", 1.0, 0.4, "c2", "new.json"), ("m", 1, "peer p", "peer", 3.0, 0.4, "c2", "new.json"),
            ("m", 2, "gdtool b", "gdtool", 1.2, 0.6, "c2", "new.json")]
    runs = pd.DataFrame([dict(model=m, batch=b, runner=r, family=f, status="ok", ms_per_step=ms, floor_ms=fl, commit=c,
                              file=path) for m, b, r, f, ms, fl, c, path in rows])
    summary = bench_table.fastest(runs)
    one, two = summary.loc[("m", 1, "?")], summary.loc[("m", 2, "?")]   # no GPU recorded: "?"
    assert (one["gdtool, fastest"], one["ms/step"], one["peer ms/step"], one["commit"]) == ("gdtool b", 1.0, 3.0, "c2")
    assert one["% of floor"] == 40.0 and pd.isna(two["peer, fastest"]) and pd.isna(two["peer ms/step"])
    # the same preset on two GPUs: one row each, side by side; the faster GPU's runner never stands for the other's
    runs = runs.assign(gpu="NVIDIA H200")
    h100 = runs[runs.file == "new.json"].assign(gpu="NVIDIA H100 80GB HBM3", file="h100.json",
                                                 ms_per_step=lambda d: d.ms_per_step * 1.3)
    summary = bench_table.fastest(pd.concat([runs, h100]))
    h100, h200 = "NVIDIA H100 80GB HBM3", "NVIDIA H200"
    assert list(summary.index) == [("m", 1, h100), ("m", 1, h200), ("m", 2, h100), ("m", 2, h200)]
    assert summary.loc[("m", 1, h100), "ms/step"] == pytest.approx(1.3)
    assert summary.loc[("m", 1, h100), "peer ms/step"] == pytest.approx(3.9)
    assert summary.loc[("m", 1, h200), "ms/step"] == 1.0


def test_bench_curve_flags_a_batch_that_decodes_fewer_tokens_a_second():
    """bench_table.curve: per runner, tok/s against batch, its ratio to the batch before, and a cliff where a larger
    batch decodes fewer tokens a second; two files of one runner at one batch keep the faster; the path is the note's
    first clause."""
    import pandas as pd
    import bench_table
    fast, compiled = "fast: fast decode forward, 2 layers", "fast: HF forward compiled (batch 9: ...)"
    rows = [(1, 1000.0, fast, "a.json"), (8, 6000.0, fast, "a.json"), (9, 5000.0, compiled, "a.json"),
            (9, 7000.0, fast, "b.json"), (16, 9000.0, compiled, "a.json")]
    runs = pd.DataFrame([dict(model="m", runner="gdtool step-graph+fast", batch=b, status="ok", tok_s=t,
                              ms_per_step=b / t * 1e3, note=n, file=f) for b, t, n, f in rows] +
                        [dict(model="m", runner="peer", batch=9, status="failed", tok_s=None, ms_per_step=None,
                              note=None, file="a.json")])
    table = bench_table.curve(runs)
    assert list(table.batch) == [1, 8, 9, 16] and list(table.cliff) == [False, False, False, False]
    assert table.path.tolist()[2:] == ["fast: fast decode forward", "fast: HF forward compiled"]
    assert table.ratio.iloc[1] == 6.0 and table.file.iloc[2] == "b.json"
    table = bench_table.curve(runs[runs.file == "a.json"])
    assert list(table.cliff) == [False, False, True, False] and round(table.ratio.iloc[2], 3) == 0.833
    for argv in ([], ["--curve"], ["--paths"]):  # no files: the usage, not a traceback from pandas
        with pytest.raises(SystemExit, match="give the bench's JSON files"):
            bench_table.main(argv)
    runs["family"] = ["gdtool"] * len(rows) + ["peer"]
    by_path = bench_table.paths(runs)  # ms/step per path at each batch, the faster named; the failed peer left out
    assert list(by_path.index.get_level_values("batch")) == [1, 8, 9, 16]
    assert by_path.loc[("m", 9), "faster"] == "fast: fast decode forward"
    assert by_path.loc[("m", 9), "fast: HF forward compiled"] == 9 / 5000.0 * 1e3
    assert by_path.loc[("m", 16), "faster"] == "fast: HF forward compiled"


def test_breakdown_counts_the_experts_a_step_reads():
    """kernel_breakdown: gdtool's MoE kernels are their own class (the experts' combine apart from the attention's);
    a MoE step's weight bytes are the bench's (the experts its tokens hit on average, from 8 of 128 at one row to
    nearly all at 64), and the breakdown of an export whose name gives the batch says them over its busy time."""
    assert [kernel_breakdown.kernel_class(n) for n in ("_combine_kernel", "_attention_combine_kernel",
                                                       "_grouped_gate_up_kernel", "_rms_gemv_kernel")] == \
        ["experts", "attention", "experts", "matmul"]
    import re
    launched = {name for module in (ROOT / "gdtool" / "kernels" / "experts").glob("*.py")
                for name in re.findall(r"def (_\w+_kernel)\(", module.read_text())}
    assert launched and launched <= set(kernel_breakdown.EXPERTS), launched - set(kernel_breakdown.EXPERTS)
    one, all_rows = (kernel_breakdown.step_weight_bytes("qwen3-30b-a3b", b) for b in (1, 64))
    dense = kernel_breakdown.linear_weight_bytes("qwen3-30b-a3b")
    assert dense < one < all_rows and 5.5e9 < one < 6.5e9 and all_rows > 55e9
    export = ROOT / "profiles" / "h200" / "nsys-gemma-fast-cb883e2" / "fast" / \
        "gemma-3-1b_b1_step-graph_node_noeos_kernelsfast.sqlite.gz"
    assert kernel_breakdown.export_batch(export) == 1
    text = kernel_breakdown.breakdown(export, "gemma-3-1b")
    assert "Weights a step reads at batch 1" in text and "2.000 GB" in text, text


def test_moe_sweep_grid_and_fastest_config():
    """The sweep's grid is every combination once; the fastest config per batch is taken among the rows whose
    output stayed within tolerance, never a peer's or a wrong config's row."""
    import moe_sweep
    cells = moe_sweep.grid(moe_sweep.GROUPED_GRID)
    assert len(cells) == len({tuple(c.items()) for c in cells}) == 3 * 2 * 2 * 2 * 2
    rows = [dict(batch=1, us_per_block=5.0, ok=False), dict(batch=1, us_per_block=9.0, ok=True, config="a"),
            dict(batch=1, us_per_block=7.0, ok=True, config="b"), dict(batch=4, us_per_block=3.0, ok=False)]
    assert {b: r["config"] for b, r in moe_sweep.fastest(rows).items()} == {1: "b"}
    assert set(moe_sweep.MODELS) == {"qwen3-30b-a3b", "gpt-oss-20b"}
    from gdtool.kernels import experts
    for space, kind in ((moe_sweep.GROUPED_GRID, experts.GroupedConfig), (moe_sweep.OSS_GRID, experts.OssConfig)):
        kind(**moe_sweep.grid(space)[0])   # the grids name the configs' own fields
    experts.Config(router_rows=1, **moe_sweep.grid(moe_sweep.SMALL_GRID)[0])
    for space in (moe_sweep.ROUTED_GRID, moe_sweep.PACKED_GRID, moe_sweep.WARPS_GRID):
        for cell in moe_sweep.grid(space):
            experts.Config(**{"router_rows": 1, **cell})
    import dataclasses
    for cell in moe_sweep.grid(moe_sweep.EARLY_GRID) + moe_sweep.grid(moe_sweep.EARLY_TILES_GRID):   # the early grids' fields
        dataclasses.replace(experts.experts_config(2048, 768, 1), **cell)
    calls = []
    assert moe_sweep.chained(lambda x: calls.append(x) or x + 1)(0) == 1 and calls == list(range(moe_sweep.CHAIN))
    with pytest.raises(SystemExit):   # an unknown grid name: argparse's error, naming the grids
        moe_sweep.main(["--grids", "packed,bogus", "--out", "/nonexistent"])


def test_moe_sweep_rules_pick_the_steadiest_config_and_where_grouped_starts():
    """steadiest: the config with the smallest worst ratio to each model's fastest, not the fastest of either;
    grouped_from: one past the largest batch where the small kernels (or, asked, gpt-oss's) beat the grouped ones,
    each against the grouped ones in the models that ran them."""
    import moe_sweep
    a, b, c = ({"block_m": 16}, {"block_m": 32}, {"block_m": 64})
    tables = [{repr(a): 10.0, repr(b): 11.0, repr(c): 15.0}, {repr(a): 30.0, repr(b): 21.0, repr(c): 20.0}]
    assert moe_sweep.steadiest(tables) == b   # a is 1.5x off the second's best, c 1.5x off the first's; b 1.1x
    rows = [dict(model="q", batch=1, variant="grouped", ok=True, us_per_block=9.0),
            dict(model="q", batch=1, variant="small", ok=True, us_per_block=10.0),
            dict(model="o", batch=1, variant="grouped", ok=True, us_per_block=10.0),
            dict(model="o", batch=1, variant="oss", ok=True, us_per_block=9.5),
            dict(model="o", batch=4, variant="grouped", ok=True, us_per_block=10.0),
            dict(model="o", batch=4, variant="oss", ok=False, us_per_block=1.0),   # wrong output: not a candidate
            dict(model="q", batch=2, variant="grouped", ok=True, us_per_block=5.0),
            dict(model="q", batch=2, variant="small", ok=True, us_per_block=6.0)]
    assert moe_sweep.grouped_from(rows) == 1                # q's small kernels lose at 1 and 2
    assert moe_sweep.grouped_from(rows, "oss") == 2         # o's win at 1; at 4 their row is wrong: not counted
    rows[-1]["us_per_block"] = 4.0
    assert moe_sweep.grouped_from(rows) == 3 and moe_sweep.grouped_from(rows, "oss") == 2   # each its own


def test_window_sweep_counts_cases_and_fails_on_a_mismatch(monkeypatch, capsys):
    """profiles/window_sweep.py: the suite's sliding-window sweep at other seeds. It runs every case of the seeds
    asked for, prints each mismatch with its case's name and exits 1 on any; bad arguments are refused by name."""
    sys.path.insert(0, str(ROOT / "tests"))
    import window_sweep
    import windows
    assert window_sweep.main(["--seeds", "3", "--arch", "mistral"]) == 0
    assert "5 cases, 0 mismatched" in capsys.readouterr().out
    cases = windows.cases("mistral", windows.patterns_of("mistral"), seed=3)
    monkeypatch.setattr(windows, "run", lambda case: [f"{case.name} step-graph: tokens differ"])
    assert window_sweep.main(["--seeds", "3", "--arch", "mistral"]) == 1
    out = capsys.readouterr().out
    assert all(f"{c.name} step-graph: tokens differ" in out for c in cases) and "5 cases, 5 mismatched" in out
    for bad, phrase in ((["--arch", "llama"], "no sliding window"), (["--seeds", "x"], "give N or A-B"),
                        (["--windows", "1-4"], "fewer than 2 slots")):
        with pytest.raises(SystemExit):
            window_sweep.main(bad)
        assert phrase in capsys.readouterr().err


@pytest.mark.slow  # ~33 s on 2 cores (inductor compiles, cold cache)
def test_fast_sweep_counts_cases_per_path_and_fails_on_a_mismatch(monkeypatch, capsys):
    """profiles/fast_sweep.py: the suite's kernels="fast" sweep at other seeds. It prints every case with the path
    the plan chose, counts the paths and the cases with the dot swap, prints each mismatch with its case's name and
    exits 1 on any; bad arguments are refused by name."""
    sys.path.insert(0, str(ROOT / "tests"))
    import fast_sweep
    import fastcases
    args = ["--seeds", "5", "--models", "tiny-llama", "qwen3_moe", "--wide", "0"]
    cases = fastcases.cases(2, 5, ("tiny-llama", "qwen3_moe"), wide=0)
    assert fast_sweep.main(args) == 0
    out = capsys.readouterr().out
    assert all(f"{fastcases.path(c):8s} {c.name}: ok" in out for c in cases) and ", 0 mismatched" in out
    counts = ', '.join(f'{sum(fastcases.path(c) == p for c in cases)} {p}' for p in fastcases.PATHS)
    assert f"4 cases ({counts}; {sum(map(fastcases.dot_swap, cases))} with the dot swap)" in out
    monkeypatch.setattr(fastcases, "run", lambda case: [f"{case.name} eager: tokens differ from generate()'s"])
    assert fast_sweep.main(args) == 1
    out = capsys.readouterr().out
    assert all(f"{c.name} eager: tokens differ" in out for c in cases) and ", 4 mismatched" in out
    for bad, phrase in ((["--models", "llama"], "not in tests/fastcases.py"), (["--seeds", "x"], "give N or A-B"),
                        (["--wide", "1.5"], "a share, from 0 to 1"), (["--per-model", "0"], "give 1 or more")):
        with pytest.raises(SystemExit):
            fast_sweep.main(bad)
        assert phrase in capsys.readouterr().err


def test_fresh_compiles_counts_the_results_of_new_processes(capsys):
    """profiles/fresh_compiles.py: one fast-sweep case decoded in fresh processes (inductor's caches off) under
    each setting; per mode, how many different results they gave. A real child process runs (a CPU, float32, the
    deterministic option on where the installed torch has it); the tally tells agreement from disagreement; an
    unknown case and a bad count are refused by name."""
    import torch._inductor.config as inductor
    import fresh_compiles
    assert fresh_compiles.main(["--case", "32923", "--processes", "2", "--jobs", "2", "--settings",
                                "deterministic", "--modes", "eager", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "tiny-llama-b2-line12-p7-pads0.5-n4-greedy-eosr0s1-poll1-s32923 on cpu" in out
    assert re.search(r"\[deterministic 2/2\] \d+ s \(done \d+ s from the start\)", out), out
    flag = "True" if hasattr(inductor, "deterministic") else "not in this torch"
    assert f"deterministic (processes: 2; inductor's deterministic option: {flag})" in out
    assert re.search(r"\n  eager +fresh compiles agree: [0-9a-f]{16} x2", out), out
    runs = [{"deterministic": False, "hashes": {"eager": h, "step-graph": "b"}} for h in ("a", "a", "c")]
    assert fresh_compiles.tally({"default": runs}, ["eager", "step-graph"])[1:] == [
        "  eager          2 different results: a x2, c x1", "  step-graph     fresh compiles agree: b x3"]
    with pytest.raises(SystemExit, match="no case seeded 7 in fastcases.cases"):
        fresh_compiles.main(["--case", "7", "--device", "cpu"])
    for bad, phrase in ((["--processes", "0"], "--processes: give 1 or more"),
                        (["--jobs", "0"], "--jobs: give 1 or more"),
                        (["--device", "tpu"], "--device 'tpu': give cuda or cpu")):
        with pytest.raises(SystemExit):
            fresh_compiles.main(["--case", "32923", *bad])
        assert phrase in capsys.readouterr().err


def test_zoo_sweep_runs_every_case_at_random_shapes_and_fails_on_a_mismatch(monkeypatch, capsys):
    """profiles/zoo_sweep.py: every causal-LM case at `--shapes` random shapes each, the shapes it ran printed;
    a mismatch or a crash is printed with its shape and makes the exit status 1."""
    sys.path.insert(0, str(ROOT / "tests"))
    import zoo
    import zoo_sweep
    assert zoo_sweep.main(["--shapes", "2", "--arch", "mistral"]) == 0
    out = capsys.readouterr().out
    assert "6 ran, 0 refused, 0 not in the zoo; 0 mismatched or crashed" in out  # mistral and its 2 window variants
    first = zoo.shapes("0-mistral", 2)[0]
    assert f"mistral b{first.batch} p{first.width} pads{first.pads} n{first.new_tokens} seed {first.seed}: ran" in out
    calls = iter([{"status": "mismatch", "error": "greedy step-graph poll=3: tokens differ"}, RuntimeError("boom")])

    def outcome(*args, **kwargs):
        found = next(calls, {"status": "ran", "results": [["greedy", "eager", 1, "pass"]]})
        if isinstance(found, Exception):
            raise found
        return found
    monkeypatch.setattr(zoo, "outcome", outcome)
    assert zoo_sweep.main(["--shapes", "2", "--arch", "mistral"]) == 1
    out = capsys.readouterr().out
    assert "mismatch: greedy step-graph poll=3: tokens differ" in out and "crashed: RuntimeError: boom" in out
    assert "2 mismatched or crashed" in out
    for bad in (["--arch", "not_a_model"], ["--skip", "falcon_hl"]):
        with pytest.raises(SystemExit):
            zoo_sweep.main(bad)
        assert f"{bad[1]}: not a causal LM" in capsys.readouterr().err


def test_zoo_sweep_names_the_cases_in_flight_when_a_worker_dies(monkeypatch, capsys):
    """A worker killed mid-case (the kernel's OOM killer, as 5.17's tiny Falcon-H1 at 24 GiB does) breaks the pool:
    the sweep names the model types in flight and the fix (--skip), and exits 1; --skip leaves a type out."""
    sys.path.insert(0, str(ROOT / "tests"))
    from concurrent.futures.process import BrokenProcessPool

    import zoo_sweep

    class Broken:
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def submit(self, fn, job):
            class Future:
                def result(self):
                    raise BrokenProcessPool("a child process terminated abruptly")
            return Future()
    monkeypatch.setattr(zoo_sweep, "ProcessPoolExecutor", Broken)
    assert zoo_sweep.main(["--shapes", "1", "--arch", "mistral", "gemma2", "--jobs", "2"]) == 1
    assert "with one of these in flight: mistral; run again with --skip" in capsys.readouterr().out
    assert zoo_sweep.main(["--shapes", "1", "--arch", "mistral", "gemma2", "--skip", "mistral", "--jobs", "2"]) == 1
    assert "in flight: gemma2;" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                    reason="Triton is not installed, or its interpreter defines the kernels (nothing to compile)")
def test_kernel_registers_catches_every_launch_and_runs_none():
    """profiles/kernel_registers.py compiles what a call launches: it catches each launch's kernel and arguments
    (q/k/v with Qwen3's q/k norm: the products, then the norm kernel) without running any, then compiles each for
    sm_90 and reads its registers from the binary."""
    import torch
    sys.path.insert(0, str(ROOT / "profiles"))
    import kernel_registers
    from gdtool.kernels import gemv
    bf = torch.bfloat16
    x, g = torch.randn(1, 64, dtype=bf), torch.ones(64, dtype=bf)
    w, wk = torch.randn(64, 64, dtype=bf), torch.randn(32, 64, dtype=bf)
    caches = [torch.zeros(1, 2, 8, 16, dtype=bf) for _ in range(2)]
    caught = kernel_registers.launches(lambda: gemv.qkv_rope(
        x, g, 1e-5, w, wk, wk, torch.zeros(1, 1, dtype=torch.long), torch.ones(8), 1.0, *caches, torch.tensor(3),
        None, (torch.ones(16, dtype=bf), torch.ones(16, dtype=bf), 1e-6), config=(2, 4, 2)))
    assert [fn.__name__ for fn, _, _ in caught] == ["_qkv_rope_gemv_kernel", "_qk_norm_rope_kernel"]
    assert all(not c.any() for c in caches)   # nothing ran
    assert caught[0][2]["HQ"] == 4 and "num_warps" in caught[0][2]
    import cuda_compile
    with cuda_compile.targeting(90):   # each compiled for sm_90 as its launch would compile there
        used = [kernel_registers._usage(fn, list(args), kwargs) for fn, args, kwargs in caught]
    assert all(u["registers"] > 0 and u["local"] == 0 and u["warps"] == kw["num_warps"]
               for u, (_, _, kw) in zip(used, caught)), used


@pytest.mark.skipif(importlib.util.find_spec("triton") is None or os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"),
                    reason="Triton is not installed, or its interpreter defines the kernels (nothing to compile)")
def test_kernel_registers_row_cases_launch_one_pass_of_each_row_count():
    """kernel_registers.py --rows: each Llama layer product of both shapes at each row count, launched (not run) in
    one pass of that many rows, its tiles named."""
    sys.path.insert(0, str(ROOT / "profiles"))
    import kernel_registers
    for rows in (1, 3):
        cases = list(kernel_registers.row_cases(rows))
        assert [name.split(" ", 1)[1] for name, _ in cases[:4]] == [f"{p}, {rows} rows" for p in
                                                                     ("q/k/v", "o", "gate/up", "down")]
        assert len(cases) == 8
        for name, call in cases:
            (fn, _, kwargs), = kernel_registers.launches(call)
            assert kwargs["ROWS"] == (4 if rows == 3 else 1) and kwargs["PASSES"] == 1, (name, kwargs["ROWS"])
            assert kernel_registers.tiles(kwargs).startswith(f"ROWS={kwargs['ROWS']} PASSES=1 ")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_dot_probe_configs_run_the_kernel_under_the_interpreter():
    """profiles/dot_gemv.py (the configs `--dot` times gdtool's split-K dot kernel at): the default is the tuning's,
    its neighbours distinct tiles of at least 16; each runs the kernel under Triton's interpreter, fp16, over seeded
    draws of rows (up to 64), N off the tiles and K off the chunks, within float32-sum rounding of F.linear."""
    from interpreter import run_interpreted
    run_interpreted(
        "import random, sys, torch\n"
        "sys.path.insert(0, 'profiles')\n"
        "import dot_gemv\n"
        "from gdtool.kernels import dot, tuning\n"
        "assert dot_gemv.default_config(64, 2048, 2048) == tuple(dot.config_for(64, 2048, 2048, tuning.defaults()))\n"
        "assert dot_gemv.default_config(4, 4096, 14336)[2] > 1 and dot_gemv.default_config(4, 128256, 4096)[2] == 1\n"
        "rng = random.Random(5)\n"
        "for _ in range(4):\n"
        "    m, n, k = rng.choice((1, 2, 3, 4, 16, 33, 64)), rng.choice((48, 96, 200)), rng.choice((512, 1000))\n"
        "    gen = torch.Generator().manual_seed(m * n)\n"
        "    x = torch.randn(m, k, generator=gen).half()\n"
        "    w = (torch.randn(n, k, generator=gen) / k ** 0.5).half()\n"
        "    ref = torch.nn.functional.linear(x.float(), w.float())\n"
        "    configs = dot_gemv.sweep_configs(m, n, k)\n"
        "    assert len(set(configs)) == len(configs) and all(c[0] >= 16 and c[1] >= 16 for c in configs), configs\n"
        "    for config in [c for c in configs if c[1] <= 256][:3] + [(32, 64, 4, 4, 2)]:\n"
        "        out = dot.dot_linear(x, w, None, config)\n"
        "        assert out.shape == (m, n) and out.dtype == torch.float16, (out.shape, out.dtype)\n"
        "        assert torch.allclose(out.float(), ref, atol=2e-3, rtol=2e-3), (m, n, k, config, (out.float() - ref).abs().max())\n"
        "print('ok')\n", timeout=600)


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_probe_gemv_part_with_dot_dry_run_on_cpu(tmp_path):
    """decode_kernels_probe.py --parts gemv --dot --device cpu (the interpreter, tiny shapes) at 2 and 64 rows: every
    projection gets cuBLAS's row and the split-K dot kernel's, at 2 rows the matrix-vector kernel's too (it takes at
    most 16), none failing (the CSV has no error)."""
    import subprocess
    import pandas as pd
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    run = subprocess.run([sys.executable, str(ROOT / "profiles" / "decode_kernels_probe.py"), "--device", "cpu",
                          "--parts", "gemv", "--models", "tiny", "--gemv-rows", "2,64", "--dot", "--sweep-models",
                          "none", "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert run.returncode == 0, run.stderr[-3000:]
    df = pd.read_csv(tmp_path / "gemv.csv")
    assert "error" not in df or df.error.isna().all(), df
    for proj in ("qkv", "o", "gate_up", "down", "lm_head"):
        for rows in (2, 64):
            kernels = df[(df.proj == proj) & (df.rows == rows)].kernel
            assert kernels.str.startswith("cublas").any() and kernels.str.startswith("triton dot").any(), \
                (proj, rows, kernels)
            # the matrix-vector kernels at their rows only (past 16: cuBLAS's and the dot kernel's rows)
            assert (kernels.str.startswith("triton") & ~kernels.str.startswith("triton dot")).any() == (rows == 2), \
                (proj, rows, kernels)


def test_default_line_list_names_committed_files_and_expands_in_bench_table(capsys):
    """profiles/h200/bench/batches/default-line.txt (the default line's curve, read by render.sh and notebook 03):
    every glob matches a committed bench file, each preset's files cover batch 1 to 64 once per batch, and
    bench_table's "@LIST:PRESET" argument expands to them (no cliff in the committed curves)."""
    import bench_table
    folder = ROOT / "profiles" / "h200" / "bench" / "batches"
    lines = [l.split("\t") for l in (folder / "default-line.txt").read_text().splitlines() if l and l[0] != "#"]
    assert all(sorted(folder.glob(pattern)) for _, pattern in lines), [p for _, p in lines if not list(folder.glob(p))]
    listed = bench_table.listed(folder / "default-line.txt")
    assert list(listed) == ["llama-1b", "llama-8b", "qwen3-8b"]
    for preset, files in listed.items():
        curve = bench_table.curve(bench_table.frame(files))
        mine = curve[curve.runner == "gdtool step-graph+fast"]
        assert mine.batch.min() == 1 and mine.batch.max() == 64 and mine.batch.is_unique, (preset, mine.batch)
        assert not mine.cliff.any(), mine
    bench_table.main(["--curve", f"@{folder / 'default-line.txt'}:llama-8b"])
    out = capsys.readouterr().out
    assert "| llama-8b | gdtool step-graph+fast | 64 |" in out and "0 cliff(s)" in out


def test_bench_table_list_arguments_refuse_bad_input_with_the_fix(tmp_path):
    """bench_table's "@LIST:PRESET": a missing list, a preset it does not name (or whose globs match nothing) and a
    line without its tab are refused with what to write, not a traceback from json or pandas."""
    import bench_table
    good = tmp_path / "list.txt"
    good.write_text("# a comment\nm\tnothing-*.json\n")
    bad = tmp_path / "bad.txt"
    bad.write_text("m nothing.json\n")
    for arg, said in ((f"@{tmp_path / 'missing.txt'}:m", "give @LIST:PRESET"), ("@:m", "give @LIST:PRESET"),
                      (f"@{good}:other", "lists no existing files for 'other'; its presets: m"),
                      (f"@{good}:m", "lists no existing files for 'm'"),
                      (f"@{bad}:m", "bad.txt:1: 'm nothing.json' is not 'preset<TAB>glob'")):
        with pytest.raises(SystemExit, match=re.escape(said)):
            bench_table.main(["--curve", arg])
