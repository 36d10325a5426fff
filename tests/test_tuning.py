"""The kernels' tuning as per-device files (gdtool/kernels/tuning.py, gdtool/kernels/configs/): which file a device
reads, what a malformed one is told, and that the H200 file makes every kernel pick what the module constants picked
before they became data (frozen copies of those functions below)."""
from __future__ import annotations

import json
import os
import shutil
import types
import warnings

import pytest
import torch

from gdtool.kernels import attention, experts, forward, gemv, tuning
from gdtool.kernels import triton as fast_triton
from gdtool.kernels.triton import cdiv, next_pow2

CONFIGS = tuning.CONFIG_DIR
H200 = os.path.join(CONFIGS, "nvidia-h200_sm90_triton-3.6.0.json")
H100 = os.path.join(CONFIGS, "nvidia-h100-80gb-hbm3_sm90_triton-3.6.0.json")


# -- the functions as they were, constants and all (gdtool before the tuning files) ---------------------------------

def old_gemv_config(m, n, k, tiles=1):
    block_k = next_pow2(k)
    block_n = max(1, min(16, (8192 // block_k) // tiles))
    warps = 4 if k < 2048 or (block_k == 4096 and block_n == 1) else 8
    per_sm = 2 if warps == 8 and block_k > 4096 else 4
    while block_n > 1 and -(-n // block_n) < 2 * 132:
        block_n //= 2
    return block_n, warps, per_sm


def old_qkv_rope_config(k, d):
    hb = max(1, min(d // 2, 4096 // next_pow2(k)))
    if next_pow2(k) in (2048, 4096):
        return hb, 4, 4, next_pow2(k)
    return hb, 8 if next_pow2(k) > 2048 else 4, 2, next_pow2(k)


def old_split_plan(batch, hkv, cache_len):
    want = max(1, 264 // max(1, batch * hkv))
    chunk = max(16, cdiv(cdiv(cache_len, want), 16) * 16)
    return chunk, cdiv(cache_len, chunk)


def old_early_keys(chunk, d):
    return min(next_pow2(chunk), max(16, 1 << max(0, (4096 // d).bit_length() - 1)))


def old_fused_plan(batch, hkv, g, cache_len, d):
    chunk, splits = old_split_plan(batch, hkv, cache_len)
    most = 16384 // (next_pow2(g) * d)
    if most < 1:
        return None
    most = 1 << (most.bit_length() - 1)
    if splits > most:
        chunk = cdiv(cdiv(cache_len, most), 16) * 16
        splits = cdiv(cache_len, chunk)
    return None if old_early_keys(chunk, d) < chunk else (chunk, splits)


def old_combine_plan(splits, d):
    block_d = min(d, 64)
    return block_d, max(2, min(next_pow2(splits), 4096 // block_d))


def old_experts_config(hidden, intermediate, tokens=1):
    kh, ki = min(next_pow2(hidden), 4096), min(next_pow2(intermediate), 4096)
    one = tokens == 1
    base = dict(router_rows=max(1, min(16, 4096 // kh)), gate_up_rows=max(1, min(16, (16384 if one else 8192) // kh)),
                down_rows=max(1, min(16, 4096 // ki)), warps=8 if one and kh >= 2048 else 4, chunk=1024)
    if one:
        base.update(chunk=256 if max(kh, ki) <= 4096 else 1024, routed=True, stacked=True, packed=True, router_rows=1,
                    router_warps=1, down_rows=max(1, base["down_rows"] // 2), down_warps=4, router_early=True,
                    down_early=True)
    return experts.Config(**base)


OLD_GROUPED = ((2, (16, 64, 128, 4, 3)), (4, (16, 64, 64, 4, 3)), (32, (16, 64, 128, 4, 3)), (64, (16, 128, 128, 8, 3)))


def old_grouped_config(tokens):
    for limit, tiles in OLD_GROUPED:
        if tokens <= limit:
            return experts.GroupedConfig(*tiles)
    return experts.GroupedConfig(*OLD_GROUPED[-1][1])


def old_line_rows(hidden):
    return next(rows for largest, rows in ((2048, 2), (None, 1)) if largest is None or hidden <= largest)


@pytest.mark.parametrize("path", [H200, os.path.join(CONFIGS, tuning.DEFAULTS)])
def test_the_h200_file_and_the_defaults_pick_what_the_constants_picked(path):
    """Over a grid of shapes, every kernel's choice read through the H200 file (132 multiprocessors) and through the
    defaults equals the choice of the constants it replaced: on the H200, and on a CPU, nothing changes."""
    tune = tuning.read(path, multiprocessors=132)
    ks = (256, 896, 1152, 1536, 2048, 2880, 3072, 4096, 5120, 6144, 8192, 14336, 16384)
    ns = (256, 512, 1024, 1152, 2048, 4096, 6912, 14336, 128256, 262144)
    for k in ks:
        for n in ns:
            for tiles in (1, 2):
                assert gemv.gemv_config(1, n, k, tiles, tune) == old_gemv_config(1, n, k, tiles), (n, k, tiles)
        for d in (64, 128, 256):
            assert gemv.qkv_rope_config(k, d, tune=tune) == old_qkv_rope_config(k, d), (k, d)
    for batch in (1, 2, 4, 16, 64):
        for hkv in (1, 2, 4, 8):
            for g in (1, 2, 4, 8, 16):
                for cache in (16, 100, 384, 1024, 4096, 32768):
                    for d in (64, 128, 256):
                        assert attention.split_plan(batch, hkv, cache, tune) == old_split_plan(batch, hkv, cache)
                        assert attention.fused_plan(batch, hkv, g, cache, d, tune) == \
                            old_fused_plan(batch, hkv, g, cache, d)
    for splits in (1, 2, 24, 33, 259, 1024):
        for d in (32, 64, 128, 256):
            assert attention.combine_plan(splits, d, tune) == old_combine_plan(splits, d)
            assert attention.early_keys(splits * 16, d, tune) == old_early_keys(splits * 16, d)
    for hidden in (512, 896, 2048, 2560, 2880, 4096, 5120, 8192):
        assert forward.line_rows(hidden, tune) == old_line_rows(hidden), hidden
        for inter in (512, 768, 1408, 2880, 8192, 14336):
            for tokens in (1, 2, 4, 16):
                assert experts.experts_config(hidden, inter, tokens, tune) == \
                    old_experts_config(hidden, inter, tokens), (hidden, inter, tokens)
    for tokens in range(1, 80):
        assert experts.grouped_config(tokens, tune) == old_grouped_config(tokens), tokens
        assert experts.runs_grouped("qwen3_moe", tokens, tune) == (tokens >= 2)
    assert experts.oss_config(tune) == experts.OssConfig(gate_up_cols=32, down_cols=32, block_k=128, warps=4)


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_every_shipped_file_is_valid_and_names_its_provenance():
    """The shipped files parse, hold every field, and each section names the committed files its values came from;
    the H100 file's from H100 sweeps, but for batch_lines, the H200's copy until an H100 bench-batches, and dot, the
    split-K dot kernel's rule, which no GPU has swept yet."""
    names = sorted(os.listdir(CONFIGS))
    assert names == ["defaults.json", os.path.basename(H100), os.path.basename(H200)]
    h100 = tuning.read(H100)
    for section in tuning.SCHEMA:
        for path in tuning.read(H200).provenance(section)["files"] + h100.provenance(section)["files"]:
            assert os.path.exists(os.path.join(ROOT, path)), path
        files = h100.provenance(section)["files"]
        if section == "batch_lines":
            assert "no H100 sweep yet" in h100.provenance(section)["sweep"]
        elif section == "dot":   # the split-K dot kernel's rule, not swept yet on either GPU: each file says so
            assert not files and all("no sweep yet" in tune.provenance(section)["sweep"]
                                     for tune in (h100, tuning.read(H200), tuning.defaults())), section
        else:
            assert files and all(f.startswith("profiles/h100/") for f in files), (section, files)
    assert h100.data["capability"] == [9, 0] and h100.data["device"] == "NVIDIA H100 80GB HBM3"


def test_the_h100_file_is_within_3_percent_of_its_own_sweeps(capsys):
    """The check an issue asks of a shipped file, on the H100 sweeps it was written from: every swept shape's
    choice within 3% of that sweep's fastest (a fresh sweep on the GPU is the same command on its new files)."""
    tf = _profiles()
    h100 = tuning.read(H100)
    gemv_files = h100.provenance("gemv")["files"]
    moe_files = sorted(set(h100.provenance("experts_small")["files"] + h100.provenance("experts_oss")["files"]))
    argv = ["--config", H100, "--gemv", *[os.path.join(ROOT, f) for f in gemv_files],
            "--moe", *[os.path.join(ROOT, f) for f in moe_files],
            "--attention", *[os.path.join(ROOT, f) for f in h100.provenance("attention")["files"]]]
    assert tf.main(argv) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert "31 of 31 within 3%" in out
    assert "ok  qwen3-30b-a3b batch 4 small" in out and "ok  qwen3-30b-a3b batch 8 grouped" in out   # the switch
    assert "ok  attention split target 66 programs" in out


FRESH_H100 = "profiles/h100/fresh-check-4750d72"


def test_the_h100_file_is_within_3_percent_of_a_fresh_sweep_and_the_h200_file_is_not(capsys):
    """The issue's check: the sweeps run again on an H100 a session later (kernels-sweep, attention-plan,
    moe-sweep at 4750d72) against the shipped H100 file: every entry within 3%. The H200 file on the same sweeps
    is out on six (its attention target, its qkv_rope tiles, the switch to the grouped kernels): why the files
    are per device."""
    tf = _profiles()
    fresh = os.path.join(ROOT, FRESH_H100)
    argv = ["--gemv", f"{fresh}/kernels-sweep/gemv.csv", "--attention", f"{fresh}/attention-plan/attention.csv",
            "--moe", f"{fresh}/moe-sweep/qwen3-30b-a3b.csv", f"{fresh}/moe-sweep/gpt-oss-20b.csv"]
    assert tf.main(["--config", H100, *argv]) == 0, capsys.readouterr().out
    assert "31 of 31 within 3%" in capsys.readouterr().out
    assert tf.main(["--config", H200, *argv]) == 1
    out = capsys.readouterr().out
    assert "25 of 31 within 3%" in out and "OUT attention split target 264 programs" in out


def test_the_experts_check_judges_the_switch_to_the_grouped_kernels_too():
    """Per model and batch the check times the path the file runs there against the fastest of both paths: a file
    that switches to the grouped kernels where the small ones are 10% faster is out, though its grouped tiles are
    the grouped rows' best; below the switch the grouped tiles themselves are not judged (a slow one is no fault),
    but grouped kernels faster than the small ones are (the switch is late)."""
    tf = _profiles()
    h100 = tuning.read(H100)

    def small(batch):
        config = vars(experts.experts_config(2048, 768, batch, h100))
        return dict(config, chunk=config["chunk"] or experts.MAX_CHUNK)

    def row(variant, config, us, batch):
        return dict(model="qwen3-30b-a3b", batch=batch, variant=variant, config=config, us_per_block=us, ok=True)
    grouped = vars(experts.grouped_config(4, h100))
    rows = [row("small", small(4), 100.0, 4), row("grouped", grouped, 110.0, 4),
            row("grouped", dict(grouped, warps=2), 120.0, 4),
            row("small", small(2), 60.0, 2), row("grouped", vars(experts.grouped_config(2, h100)), 90.0, 2),
            row("grouped", dict(vars(experts.grouped_config(2, h100)), warps=2), 61.0, 2),
            row("small", small(1), 60.0, 1), row("grouped", dict(vars(experts.grouped_config(1, h100)), warps=2), 50.0, 1)]
    assert experts.grouped_from(h100) == 5
    report = {r["entry"]: r for r in tf.agreement(tf.moe_entries(rows, h100))}
    assert report["qwen3-30b-a3b batch 4 small"]["ok"] and report["qwen3-30b-a3b batch 4 small"]["ratio"] == 1
    assert report["qwen3-30b-a3b batch 2 small"]["ok"]                           # its grouped tiles' 90 µs: no matter
    assert not report["qwen3-30b-a3b batch 1 small"]["ok"] and report["qwen3-30b-a3b batch 1 small"]["ratio"] == 1.2
    switched = h100.with_values("experts_grouped", from_tokens=4)
    report = {r["entry"]: r for r in tf.agreement(tf.moe_entries(rows, switched))}
    assert not report["qwen3-30b-a3b batch 4 grouped"]["ok"] and report["qwen3-30b-a3b batch 4 grouped"]["ratio"] == 1.1


def _props(name="NVIDIA H100 80GB HBM3", major=9, minor=0, sms=132):
    return types.SimpleNamespace(name=name, major=major, minor=minor, multi_processor_count=sms)


def test_a_device_reads_its_own_file_by_name_capability_and_triton(recwarn):
    """Name, capability and Triton version pick the file, silently; the multiprocessor count is the device's."""
    tune = tuning.for_properties(_props(sms=114), "3.6.0")
    assert tune.source == H100 and tune.why == "" and tune.multiprocessors == 114
    assert tuning.for_properties(_props("NVIDIA H200"), "3.6.0").source == H200
    assert not [w for w in recwarn if issubclass(w.category, tuning.TuningWarning)]


def test_a_device_without_its_file_reads_the_nearest_of_its_capability_and_says_so_once(tmp_path, monkeypatch):
    """Another Triton version: the file of the same capability at the nearest version (its own name first among
    equals); the warning names the file and why, once."""
    for path in (H200, H100):
        shutil.copy(path, tmp_path)
    data = json.load(open(H200))
    data["triton"] = "3.4.0"
    (tmp_path / "nvidia-h200_sm90_triton-3.4.0.json").write_text(json.dumps(data))
    monkeypatch.setattr(tuning, "_said", set())
    with pytest.warns(tuning.TuningWarning, match=r"no tuning file for NVIDIA H200 \(sm_90, Triton 3.5.1\): using "
                                                    r"nvidia-h200_sm90_triton-3.4.0.json"):
        assert tuning.for_properties(_props("NVIDIA H200"), "3.5.1", str(tmp_path)).source.endswith("3.4.0.json")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tuning.for_properties(_props("NVIDIA H200"), "3.5.1", str(tmp_path))   # said already: no second warning
    path, why = tuning.find("NVIDIA H100 PCIe", (9, 0), "3.7.0", str(tmp_path))
    assert os.path.basename(path) == os.path.basename(H100) and "nearest of the same capability" in why


def test_a_device_of_no_file_of_its_capability_reads_the_defaults_and_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(tuning, "_said", set())
    shutil.copy(os.path.join(CONFIGS, tuning.DEFAULTS), tmp_path)
    shutil.copy(H200, tmp_path)
    with pytest.warns(tuning.TuningWarning, match=r"NVIDIA A100-SXM4-80GB \(sm_80, Triton 3.6.0\) nor any of its "
                                                    r"capability: using the defaults"):
        tune = tuning.for_properties(_props("NVIDIA A100-SXM4-80GB", 8, 0, 108), "3.6.0", str(tmp_path))
    assert os.path.basename(tune.source) == tuning.DEFAULTS and tune.multiprocessors == 108
    # the multiprocessor count is the device's: 288 four-row tiles of an o projection of 1152 fill 2 a multiprocessor
    # of 108 or 132, not of 160 (two-row tiles there)
    assert gemv.gemv_config(1, 1152, 1152, 1, tune) == (4, 4, 4) == old_gemv_config(1, 1152, 1152)
    assert gemv.gemv_config(1, 1152, 1152, 1, tuning.read(H200, multiprocessors=160)) == (2, 4, 4)
    assert attention.target_programs(tune) == 216 and attention.target_programs(tuning.defaults()) == 264


def test_a_cpu_reads_the_defaults_and_a_probe_passes_its_own_values():
    assert tuning.current(torch.device("cpu")) is tuning.defaults() is tuning.current()
    tried = tuning.defaults().with_values("attention", programs_per_sm=1)
    with tuning.use(tried):
        assert tuning.current(torch.device("cpu")) is tried
        assert attention.split_plan(1, 8, 384) == (32, 12)   # 132 programs, not 264
    assert attention.split_plan(1, 8, 384) == (16, 24)
    with tuning.use(forward.batch_line(8)):
        assert forward.gemv_rows(forward.line_paths(4096)) == 8
    assert forward.gemv_rows(forward.line_paths(4096)) == 1


def test_the_interpreter_reads_larger_gemv_tiles_with_the_defaults_reductions_and_splits(monkeypatch):
    """Under Triton's interpreter a CPU reads `tuning.interpreter()`: one multiprocessor and GEMV tiles of up to 128
    rows, so fewer, larger operations. Over a seeded sweep of shapes: GEMV tiles at least the defaults' rows (K is
    whole in a tile either way, so each row's sum is the same), the defaults' q/k/v tiles and attention splits.
    Without the interpreter, the defaults. (A decode under the interpreter gives the defaults' bits:
    test_fast_kernels.py's folded-embedding interpreter test.)"""
    import random
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    tune, base = tuning.current(torch.device("cpu")), tuning.defaults()
    assert tune is tuning.interpreter() is tuning.current() and tune.multiprocessors == 1 and tune.why
    assert gemv.gemv_config(1, 4096, 64, 1, tune)[0] == 128 > gemv.gemv_config(1, 4096, 64, 1, base)[0]  # an lm_head
    rng = random.Random(0)
    for _ in range(300):
        m, n, k = rng.randint(1, 64), rng.choice([64, 96, 1152, 4096, 50257]), rng.randint(1, 8192)
        tiles = rng.choice([1, 2])
        ours, theirs = gemv.gemv_config(m, n, k, tiles, tune), gemv.gemv_config(m, n, k, tiles, base)
        assert ours[0] >= theirs[0] and gemv.qkv_rope_config(k, 64, m, tune=tune) == gemv.qkv_rope_config(
            k, 64, m, tune=base), (m, n, k, tiles)
        batch, hkv, cache = rng.randint(1, 64), rng.choice([1, 2, 8]), rng.randint(1, 4096)
        assert attention.split_plan(batch, hkv, cache, tune) == attention.split_plan(batch, hkv, cache, base)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert tuning.current(torch.device("cpu")) is base


@pytest.mark.parametrize("change, message", [
    (lambda d: d["gemv"].update(tile_elements="8192"), r"x.json: gemv.tile_elements: expected a positive integer, got "
                                                       r"'8192'"),
    (lambda d: d["attention"].pop("block_s"), r"attention.block_s: expected present"),
    (lambda d: d["gemv"]["launch"].pop(), r"gemv.launch\[2\]: expected the last row without \"when\""),
    (lambda d: d["experts_grouped"]["tiles"][0].update(block_n=0), r"experts_grouped.tiles\[0\].block_n: expected a "
                                                                   r"positive integer"),
    (lambda d: d["qkv_rope"]["launch"][0]["when"].update(blockk=4), r"qkv_rope.launch\[0\].when: expected conditions"),
    (lambda d: d["experts_oss"].update(warp=4), r"experts_oss.warp: expected not a field"),
    (lambda d: d["batch_lines"]["provenance"].pop("commit"), r"batch_lines.provenance.commit: expected present"),
    (lambda d: d.update(capability="sm_90"), r"capability: expected \[major, minor\]"),
])
def test_a_malformed_file_is_refused_naming_the_file_and_the_field(tmp_path, change, message):
    data = json.load(open(H200))
    change(data)
    path = tmp_path / "x.json"
    path.write_text(json.dumps(data))
    with pytest.raises(tuning.ConfigError, match=message):
        tuning.read(str(path))
    path.write_text("{")
    with pytest.raises(tuning.ConfigError, match="x.json: not JSON"):
        tuning.read(str(path))


def test_tested_kernel_paths_are_keyed_by_capability_and_triton(monkeypatch):
    """An H100 runs what passed on sm_90 with the same Triton (its key is the H200's); another capability or Triton
    minor release is refused, the reason naming both."""
    monkeypatch.delenv("GDTOOL_UNTESTED_KERNELS", raising=False)
    cuda, path = torch.device("cuda"), "Llama, <= 4 rows"
    assert path in fast_triton.CUDA_TESTED[((9, 0), "3.6")]
    monkeypatch.setattr(fast_triton, "kernel_key", lambda device: ((9, 0), "3.6"))
    assert fast_triton.untested_on_cuda(path, cuda) == ""
    monkeypatch.setattr(fast_triton, "kernel_key", lambda device: ((9, 0), "3.7"))
    assert "on sm_90 with Triton 3.7 yet (tested there: none)" in fast_triton.untested_on_cuda(path, cuda)
    monkeypatch.setattr(fast_triton, "kernel_key", lambda device: ((8, 0), "3.6"))
    assert "on sm_80 with Triton 3.6" in fast_triton.untested_on_cuda(path, cuda)
    assert fast_triton.untested_on_cuda(path, torch.device("cpu")) == ""


def _profiles():
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "profiles"))
    import tuning_files
    return tuning_files


def test_the_check_says_per_entry_whether_the_shipped_choice_is_within_3_percent_of_the_sweep(tmp_path):
    """A synthetic gemv sweep: the H200 file's pick at 2% over the fastest passes, at 5% fails, untimed fails; and the
    sweep's picks written as exact-shape rows make the file choose the fastest."""
    tf = _profiles()
    h200 = tuning.read(H200)
    path = tmp_path / "gemv.csv"
    rows = ["model,proj,rows,n,k,kernel,pdl,us"]
    picked = gemv.gemv_config(1, 2048, 2048, 1, h200)            # (4, 8, 4)
    for config, us in ((picked, 10.2), ((8, 8, 4), 10.0), ((2, 4, 4), 12.0)):
        rows.append(f'llama-1b,o,1,2048,2048,"triton rms_gemv {config}",False,{us}')
    rows.append('llama-1b,o,1,2048,2048,"triton rms_gemv (1, 4, 4)",True,1.0')     # PDL on: not the sweep's
    picked = gemv.gemv_config(1, 8192, 2048, 2, h200)
    rows += [f'llama-1b,gate_up,1,8192,2048,"triton rms_gemv {picked}",False,21.0',
             'llama-1b,gate_up,1,8192,2048,"triton rms_gemv (1, 4, 2)",False,20.0',
             'llama-1b,qkv,1,3072,2048,"triton qkv_rope (1, 4, 4)",False,6.0']
    path.write_text("\n".join(rows) + "\n")
    timed = tf.gemv_timings(path)
    report = {r["entry"].split(")")[0]: r for r in tf.agreement(tf.gemv_entries(timed, h200))}
    assert report["gemv (2048, 2048, 1"]["ok"] and abs(report["gemv (2048, 2048, 1"]["ratio"] - 1.02) < 1e-9
    assert not report["gemv (8192, 2048, 2"]["ok"]                       # 21 against 20: 5% over
    assert not report["qkv_rope (2048, 64"]["ok"] and report["qkv_rope (2048, 64"]["shipped_us"] is None
    swept = h200
    for section, values in tf.gemv_sections(timed).items():
        swept = swept.with_values(section, **values)
    assert all(r["ok"] and r["ratio"] == 1 for r in tf.agreement(tf.gemv_entries(timed, swept)))
    assert gemv.gemv_config(1, 4096, 2048, 1, swept) == gemv.gemv_config(1, 4096, 2048, 1, h200)   # unswept: rule


def test_write_adopts_committed_sweeps_with_their_own_commit_and_paths(tmp_path, capsys):
    """`tuning_files.py --write`: the H100 sweeps written into a copy of the file give the shipped file's sections
    back, each naming the files as given and the commit of the env.json beside them; no files, or a file without
    its run's env.json, is refused with what to do."""
    tf = _profiles()
    h100 = tuning.read(H100)
    path = str(tmp_path / "h100.json")
    shutil.copy(H100, path)
    given = {kind: h100.provenance(section)["files"] for kind, section in (
        ("--gemv", "gemv"), ("--attention", "attention"), ("--moe", "experts_grouped"))}
    argv = ["--config", path, "--write"] + [arg for kind, files in given.items() for arg in (kind, *files)]
    cwd = os.getcwd()
    try:
        os.chdir(ROOT)   # the provenance names the paths as given: repository-relative, run from its root
        assert tf.main(argv) == 0
    finally:
        os.chdir(cwd)
    written = tuning.read(path)
    for section in ("gemv", "qkv_rope", "attention", "experts_small", "experts_oss", "experts_grouped"):
        values = {k: v for k, v in written[section].items() if k != "provenance"}   # the date is today's
        assert values == {k: v for k, v in h100[section].items() if k != "provenance"}, section
        assert written.provenance(section)["files"] == h100.provenance(section)["files"]
        assert written.provenance(section)["commit"] == "1bc10cb"
    with pytest.raises(SystemExit):
        tf.main(["--config", path, "--write"])
    assert "give their files (--gemv, --attention, --moe)" in capsys.readouterr().err
    lone = tmp_path / "gemv.csv"
    shutil.copy(os.path.join(ROOT, given["--gemv"][0]), lone)
    with pytest.raises(SystemExit):
        tf.main(["--config", path, "--write", "--gemv", str(lone)])
    assert f"no env.json (or env-*.json) naming a git_commit beside {lone}" in capsys.readouterr().err


def test_the_moe_sweep_writes_the_grouped_table_it_was_read_from(tmp_path, monkeypatch):
    """The H200 grouped sweeps, written through moe_sections into a copy of the H100 file, give the H200 file's table
    and gpt-oss's grouped_from, with the new provenance; the small kernels' start (no small rows) and the other
    sections stay."""
    tf = _profiles()
    import moe_sweep
    h200 = tuning.read(H200)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    rows = [r for p in h200.provenance("experts_grouped")["files"] for r in moe_sweep.load(os.path.join(root, p))]
    path = str(tmp_path / "h100.json")
    shutil.copy(H100, path)
    monkeypatch.setenv("GDTOOL_COMMIT", "abc1234")
    sections = tf.moe_sections([r for r in rows if r["variant"] in ("grouped", "oss")])
    tf.update(path, sections, "moe_sweep.py --model gpt-oss-20b", ["OUT/gpt-oss-20b.csv"])
    written = tuning.read(path)
    assert written["experts_grouped"]["tiles"] == h200["experts_grouped"]["tiles"]
    assert written["experts_oss"]["grouped_from"] == 2 and written["experts_oss"]["block_k"] == 128
    assert written["experts_grouped"]["from_tokens"] == tuning.read(H100)["experts_grouped"]["from_tokens"]
    assert written.provenance("experts_grouped")["commit"] == "abc1234"
    assert written.provenance("gemv") == tuning.read(H100).provenance("gemv")
