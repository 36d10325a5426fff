"""One command-line grammar (gdtool.frontends.options) for run, bench, profile (in-process, --nsys, --read) and sweep:
the same option names and list syntax, help with a default on every option, this machine's default model,
one-line errors with exit 2 for bad values, a progress bar on stderr, --json."""
from __future__ import annotations

import importlib
import json

import pytest
import torch

from gdtool import __main__ as entry
from gdtool.frontends import bench, run as cli, options, profile as profile_cli

sweep_module = importlib.import_module("gdtool.frontends.sweep")  # gdtool.sweep is the function

PARSERS = {"run": cli.parser, "bench": bench.parser, "profile": profile_cli.parser, "sweep": sweep_module.parser}
MAINS = {"run": cli.main, "bench": bench.main, "profile": profile_cli.main, "sweep": sweep_module.main}
SHARED = {"--model", "--mode", "--batch", "--max-new-tokens", "--prompt-len", "--seed", "--json", "--no-progress"}
TINY = {"run": ["--batch", "1", "--max-new-tokens", "3", "--prompt-len", "3", "--mode", "eager", "step-graph",
                "--warmup", "0"],
        "bench": ["--batch", "1", "--max-new-tokens", "3", "--prompt-len", "3", "--repeats", "1", "--mode", "eager",
                  "--peers", "none"],
        "profile": ["--batch", "1", "--max-new-tokens", "3", "--prompt-len", "3", "--mode", "eager", "step-graph",
                    "--warmup", "0"],
        "sweep": ["--batch", "1", "--max-new-tokens", "3", "--prompt-len", "3", "--mode", "step-graph", "--poll", "1",
                  "--lengths", "fixed:2", "--repeats", "1", "--warmup", "0"]}


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _options(parser):
    return {s: a for a in parser._actions for s in a.option_strings}


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_help_shows_a_default_for_every_option(command, capsys):
    with pytest.raises(SystemExit) as exit_info:
        MAINS[command](["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    assert f"python -m gdtool {command}" in text
    formatter = PARSERS[command]()._get_formatter()
    for action in PARSERS[command]()._actions:
        if not action.option_strings or action.dest == "help":
            continue
        help_text = formatter._get_help_string(action)
        assert action.help, f"{command} {action.option_strings[0]} has no help text"
        assert "(default" in help_text, f"{command} {action.option_strings[0]}: no default in {help_text!r}"
    assert "here tiny-llama)" in " ".join(text.split())  # the default model named for this machine (a CPU)


def test_profile_help_shows_nsys_and_read(capsys):
    with pytest.raises(SystemExit):
        profile_cli.main(["--help"])
    text = capsys.readouterr().out
    for flag in ("--nsys", "--read", "--trace", "--keep-report", "--no-busy", "--warmup"):
        assert flag in text


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_shared_option_names_and_list_syntax(command):
    parser = PARSERS[command]()
    names = set(_options(parser))
    assert SHARED <= names, SHARED - names
    for alias in ("--models", "--modes", "--batches", "--prompt-length"):
        assert alias in names, alias
    if command != "bench":
        assert {"--poll", "--polls", "--eos-poll-interval"} <= names
    if command != "sweep":
        assert "--kernels" in names
    if command != "run":
        assert {"--out", "--redo"} <= names
    spaces = parser.parse_args(["--batch", "1", "4", "--model", "tiny-llama"])
    commas = parser.parse_args(["--batches", "1,4", "--models", "tiny-llama"])
    repeated = parser.parse_args(["--batch", "1", "--batch", "4", "--model", "tiny-llama"])
    assert spaces.batch == commas.batch == repeated.batch == [1, 4]
    assert spaces.model == ["tiny-llama"]


def test_lengths_keep_their_commas():
    args = sweep_module.parser().parse_args(["--lengths", "list:3,5", "geom:8:32,fixed:4"])
    assert args.lengths == ["list:3,5", "geom:8:32", "fixed:4"]


BAD = [
    ("run", ["--batch", "0"], "batch 0 must be at least 1"),
    ("run", ["--model", "gpt5"], "unknown model 'gpt5'; use a preset"),
    ("run", ["--mode", "fast"], "unknown mode 'fast'; choose from eager"),
    ("run", ["--poll", "sometimes"], "polling policy 'sometimes' is not an interval"),
    ("run", ["--kernels", "fused"], "unknown kernels 'fused'; choose from hf, compiled"),
    ("run", ["--prompt-len", "9,3"], "LO > HI; swap them"),
    ("run", ["--eos-token-id", "x"], "is not a whole number"),
    ("bench", ["--peers", "gpt-fst"], "unknown peer 'gpt-fst'; choose from"),
    ("bench", ["--mode", "step-graph+fused"], "unknown kernels 'fused'"),
    ("bench", ["--batch", "1,x"], "batch 'x' is not a whole number"),
    ("bench", ["--model", "gpt5"], "unknown model"),
    ("bench", ["--kernels", "fused"], "unknown kernels"),
    ("profile", ["--batch", "-1"], "must be at least 1"),
    ("profile", ["--mode", "graph"], "unknown mode 'graph'"),
    ("profile", ["--poll", "-2"], "is not an interval"),
    ("profile", ["--kernels", "triton"], "unknown kernels"),
    ("profile", ["--model", "gpt5"], "unknown model"),
    ("profile", ["--nsys", "--trace", "kernel"], "unknown trace 'kernel'; choose from graph, node"),
    ("profile", ["--trace", "node"], "--trace is an Nsight Systems option; add --nsys"),
    ("profile", ["--nsys", "--mode", "device-loop"], "--nsys traces eager, forward-graph, step-graph"),
    ("profile", ["--nsys", "--warmup", "2"], "--warmup is an in-process option"),
    ("profile", ["--set", "eos_poll_interval"], "is not KEY=VALUE"),
    ("profile", ["--set", "bogus=1"], "--set bogus: unknown setting; --set takes do_sample, temperature"),
    ("profile", ["--set", "tempreature=0.5"], "did you mean temperature?"),
    ("profile", ["--set", "repetition_penalty=abc"], "--set repetition_penalty='abc': repetition_penalty takes a "
                                                     "number > 0"),
    ("profile", ["--set", "top_p=1.5"], "top_p takes a number in (0, 1]"),
    ("profile", ["--set", "top_k=2.5"], "top_k takes a whole number >= 0"),
    ("profile", ["--set", "do_sample=maybe"], "do_sample takes true or false"),
    ("profile", ["--set", "eos_token_id=x"], "eos_token_id takes a token id"),
    ("profile", ["--set", "eos_poll_interval=sometimes"], "eos_poll_interval takes a whole number k >= 1"),
    ("profile", ["--set", "kernels=fused"], "kernels takes hf, compiled or fast"),
    ("profile", ["--set", "min_p=0.1"], "--set min_p=0.1 (given) changes generate()'s output and gdtool does not "
                                        "implement it"),
    ("profile", ["--set", "max_new_tokens=4"], "--set max_new_tokens=...: use --max-new-tokens instead"),
    ("profile", ["--set", "fuse_projections=true"], "fuse_projections is an Nsight Systems setting; add --nsys"),
    ("profile", ["--nsys", "--set", "fuse_projections=2"], "fuse_projections takes true or false"),
    ("run", ["--model", "/nonexistent/folder"], "model folder /nonexistent/folder does not exist"),
    ("run", ["--device", "tpu"], "unknown device 'tpu'; use cpu, cuda or cuda:N"),
    ("run", ["--do-sample", "--top-p", "1.5"], "argument --top-p: --top-p '1.5': give a number in (0, 1]"),
    ("run", ["--temperature", "abc"], "--temperature 'abc': give a number > 0"),
    ("run", ["--repetition-penalty", "0"], "--repetition-penalty '0': give a number > 0"),
    ("run", ["--top-k", "-1"], "top-k -1 must be at least 0"),
    ("run", ["--pad-token-id", "-5"], "pad-token-id -5 must be at least 0"),
    ("sweep", ["--max-seconds", "-1"], "--max-seconds '-1': give a number of seconds > 0"),
    ("sweep", ["--out", "a-folder/"], "--out a-folder/: cannot write there (is a folder, not a file)"),
    ("bench", ["--device", "cuda:x"], "unknown device 'cuda:x'"),
    ("bench", ["--model", "./no-such-checkpoint"], "model folder ./no-such-checkpoint does not exist"),
    ("profile", ["--model", "~/no-such-checkpoint"], "model folder ~/no-such-checkpoint does not exist"),
    ("sweep", ["--model", "org/no-such-model"], "is neither a preset"),
    ("sweep", ["--polls", "sometimes"], "polling policy 'sometimes'"),
    ("sweep", ["--lengths", "zipf:3"], "unknown length distribution 'zipf:3'"),
    ("sweep", ["--batches", "0"], "must be at least 1"),
    ("sweep", ["--modes", "eager,fast"], "unknown mode 'fast'"),
    ("sweep", ["--models", "gpt5"], "unknown model"),
    ("sweep", ["--repeats", "0"], "repeats 0 must be at least 1"),
    # an option of the grammar that this command does not take: the commands that do are named
    ("run", ["--lengths", "garbage"], "--lengths garbage; --lengths is an option of bench --workload rollout and sweep, "
                                      "not of run"),
    ("bench", ["--poll", "4"], "--poll is an option of run, profile and sweep, not of bench"),
    ("sweep", ["--kernels", "fast"],
     "--kernels is an option of run, bench, bench --workload rollout and profile, not of sweep"),
    ("profile", ["--device", "cpu"], "--device is an option of run, bench and bench --workload rollout, not of profile"),
]


@pytest.mark.parametrize("command, argv, message", BAD, ids=[f"{c} {' '.join(a)}" for c, a, _ in BAD])
def test_a_bad_value_is_one_line_and_exit_2(command, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        MAINS[command](argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    assert err.startswith(f"python -m gdtool {command}: error:") and message in err, err


def test_a_bad_setting_found_late_is_one_line_too(capsys):
    """A value only decode can judge (an EOS id outside the model's vocabulary; top_p=1.5 is now caught by the
    parser, below) still ends the command with one line, exit 2."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main(TINY["run"] + ["--eos-token-id", "99999", "--no-progress"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("python -m gdtool run: error: eos_token_id 99999 is outside the vocabulary")


def test_unknown_command(capsys):
    assert entry.main(["profil"]) == 2
    assert "unknown command 'profil'" in capsys.readouterr().err
    assert entry.main([]) == 0 and "profile" in capsys.readouterr().out


@pytest.mark.parametrize("command", sorted(PARSERS))
def test_default_model_progress_bar_json_and_the_cpu_note(command, tmp_path, capsys):
    """No --model on a CPU: tiny-llama. Without --no-progress: a tqdm bar on stderr. With --json: one JSON
    document on stdout and the readable table (with the note that nothing was captured) on stderr."""
    argv = TINY[command] + (["--out", str(tmp_path / "out.csv" if command == "sweep" else tmp_path)]
                            if command != "run" else [])
    assert MAINS[command](argv + ["--json"]) == 0
    captured = capsys.readouterr()
    doc = json.loads(captured.out)
    assert "tiny-llama" in captured.out
    assert "%|" in captured.err, captured.err            # tqdm's bar
    assert options.UNCAPTURED in captured.err
    assert doc.get("captured") is False
    assert MAINS[command](argv + ["--no-progress", "--redo"] if command != "run" else argv + ["--no-progress"]) == 0
    captured = capsys.readouterr()
    assert "%|" not in captured.err and options.UNCAPTURED in captured.out and not captured.out.startswith("{")


# Grids of a known size on top of TINY, and what the line before the first config must count: (extra arguments,
# configs, decodes, decode steps). bench: batch 1 and 2, each running eager and generate(), each runner a warm-up and
# one timed decode of 2 steps; profile: batch 1 and 2 x eager and step-graph, one decode of 2 steps each; sweep:
# batch 1 and 2 x poll 1 (fixed:2 ends after 1 step) and never (all 2 steps), one decode each.
GRIDS = {"bench": (["--batch", "2", "--peers", "generate"], 2, 8, 16),
         "profile": (["--batch", "2"], 4, 4, 8),
         "sweep": (["--batch", "2", "--poll", "never"], 4, 4, 6)}


@pytest.mark.parametrize("command", sorted(GRIDS))
def test_long_commands_say_what_is_coming_and_count_configs(command, tmp_path, capsys):
    """Before its first config a command prints one line: the configs it will run, the decodes and steps they hold,
    and an estimate of the time with the rates it rests on. Its progress bar counts configs (not runners, passes or
    decodes). Run again, the line says every config is already there."""
    import re
    extra, configs, decodes, steps = GRIDS[command]
    out = tmp_path / ("out.csv" if command == "sweep" else "out")
    argv = TINY[command] + extra + ["--out", str(out)]
    assert MAINS[command](argv) == 0
    captured = capsys.readouterr()
    first = captured.out.splitlines()[0]
    assert first.startswith(f"{command}: {configs} configs to run (none in {out} yet); estimate ~"), first
    assert f": {decodes} decodes, ~{steps} steps expected, at " in first, first
    assert re.search(r"at [\d.]+(-[\d.]+)? ms/step and [\d.]+(-[\d.]+)? ms/prefill timed here \(short ", first), first
    counts = re.findall(r"\| *(\d+)/(\d+) \[[^\]]*config", captured.err)
    assert counts and counts[-1] == (str(configs), str(configs)), captured.err[-600:]
    assert not re.search(r"(runner|pass|decode)/s|s/(runner|pass|decode)", captured.err)
    assert MAINS[command](argv + ["--no-progress"]) == 0
    again = capsys.readouterr().out.splitlines()[0]
    assert again == (f"{command}: 0 configs to run ({configs} of {configs} already in {out}, same config hash: "
                     "skipped); nothing to measure (--redo measures them again)")


def test_run_says_uncaptured_where_a_graph_mode_captured_nothing(capsys):
    """On a CPU step-graph captures and replays nothing: its row says "uncaptured" in the replays and capture ms
    columns (eager's keeps its zeros), and its JSON figures count no replay or capture, only the launches of
    the uncaptured step."""
    assert cli.main(TINY["run"] + ["--no-progress", "--json"]) == 0
    captured = capsys.readouterr()
    figures = json.loads(captured.out)["runs"][0]["figures"]
    graph = figures["step-graph"]
    assert graph["captured"] is False and graph["replays"] == graph["captures"] == 0
    assert graph["launches"] == graph["steps"] == 2
    rows = {line.split()[0]: line.split() for line in captured.err.splitlines()
            if line.startswith(("run ", "eager ", "step-graph "))}
    assert rows["run"][5:6] == ["replays"] and rows["run"][11:13] == ["capture", "ms"]
    assert rows["step-graph"][5] == rows["step-graph"][10] == "uncaptured"
    assert rows["eager"][5] == "0" and rows["eager"][10] == "0.00"


def test_profile_names_the_model_in_its_table(tmp_path, capsys):
    assert profile_cli.main(TINY["profile"] + ["--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if "host_us" in line)
    assert header.split()[:3] == ["model", "batch", "mode"] and "tiny-llama" in out


def test_set_values_are_converted_before_anything_runs():
    p = profile_cli.parser()
    assert options.settings(["repetition_penalty=1.1", "top_k=5", "eos_token_id=2,7", "do_sample=true",
                             "eos_poll_interval=async", "kernels=compiled", "temperature=null", "min_p=null"], p) == \
        dict(repetition_penalty=1.1, top_k=5, eos_token_id=[2, 7], do_sample=True, eos_poll_interval="async",
             kernels="compiled", temperature=None, min_p=None)
    assert options.settings(["eos_token_id=null", "eos_poll_interval=16"], p) == dict(eos_token_id=None,
                                                                                    eos_poll_interval=16)


@pytest.mark.parametrize("command", ["bench", "profile", "sweep"])
def test_an_unwritable_out_fails_before_any_work(command, tmp_path, capsys, monkeypatch):
    """--out under a regular file cannot be made: one line naming --out, exit 2, before any model loads."""
    (tmp_path / "a-file").write_text("")
    bad = tmp_path / "a-file" / ("x.csv" if command == "sweep" else "x")
    monkeypatch.setattr(options, "run", lambda *a: pytest.fail("the command ran before --out was checked"))
    with pytest.raises(SystemExit) as exit_info:
        MAINS[command](TINY[command] + ["--out", str(bad)])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"error: --out {bad}: cannot write there" in err, err


@pytest.mark.parametrize("command", ["bench", "profile", "sweep"])
def test_results_go_to_an_ignored_folder_by_default_and_the_command_says_where(command, tmp_path, capsys,
                                                                                monkeypatch):
    import pathlib
    root = pathlib.Path(__file__).resolve().parent.parent
    assert "/results/" in (root / ".gitignore").read_text().splitlines()
    monkeypatch.chdir(tmp_path)
    assert MAINS[command](TINY[command] + ["--no-progress"]) == 0
    out = capsys.readouterr().out
    where = tmp_path / "results" / {"bench": "bench", "profile": "profile", "sweep": "sweep.csv"}[command]
    assert where.exists() and [p.name for p in tmp_path.iterdir()] == ["results"]
    assert f"results in {where}" in out


@pytest.fixture(scope="module")
def checkpoint_without_tokenizer(tmp_path_factory):
    import gdtool
    folder = tmp_path_factory.mktemp("checkpoint")
    gdtool.load_model("tiny-llama", seed=0).save_pretrained(folder)
    return folder


def test_a_checkpoint_without_a_tokenizer_prints_token_ids_and_says_so(checkpoint_without_tokenizer, capsys):
    argv = ["--model", str(checkpoint_without_tokenizer), "--mode", "eager", "--batch", "2", "--max-new-tokens", "3",
            "--prompt-len", "3", "--warmup", "0", "--no-progress"]
    assert cli.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    start = lines.index(f"no tokenizer in {checkpoint_without_tokenizer}: the generated tokens as ids")
    for row in range(2):
        ids = json.loads(lines[start + 1 + row].split("] ", 1)[1])
        assert lines[start + 1 + row].startswith(f"[{row}] ") and len(ids) == 3 and all(isinstance(i, int) for i in ids)
    assert not any(line.strip() in ("", "[0]", "[1]") for line in lines[start:])


def test_a_folder_that_is_no_checkpoint_is_named(tmp_path, capsys):
    (tmp_path / "weights.bin").write_text("")
    for model, message in ((tmp_path, f"model folder {tmp_path} has no config.json"),
                           (tmp_path / "weights.bin", f"model {tmp_path / 'weights.bin'} is a file")):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["--model", str(model)])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and message in err, err


def test_prompt_text_without_a_tokenizer_names_the_checkpoint_folder(checkpoint_without_tokenizer, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["--model", str(checkpoint_without_tokenizer), "--prompt", "hello", "--max-new-tokens", "2",
                  "--no-progress"])
    assert exit_info.value.code == 2
    assert "this checkpoint folder has none" in capsys.readouterr().err.strip().splitlines()[-1]


@pytest.mark.parametrize("command, argv, message", BAD, ids=[f"{c} {' '.join(a)}" for c, a, _ in BAD])
def test_a_refused_command_writes_nothing(command, argv, message, tmp_path, monkeypatch, capsys):
    """No results folder appears for a command that was refused, whatever its default --out."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit):
        MAINS[command](argv)
    assert list(tmp_path.iterdir()) == []
