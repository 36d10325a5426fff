"""docs/cli.md's account of the command line's grammar, held to the parsers themselves.

Each command's options are read from the argparse parser its module builds (`parser()`, for every entry of
`gdtool.frontends.options.COMMANDS`: run, bench, bench's rollout workload, profile, sweep), never from a list
kept here, and docs/cli.md's grammar passage (under "The command line") must say what they say: the options all
four commands take, its table of which command takes which, which of them take lists, the old spellings.
`--kernels`' help is made from the tables the fast step decides with; it must name every family they hold.

No model is loaded: the checks build parsers and read docs/cli.md.
"""
from __future__ import annotations

import argparse
import importlib
import re
from pathlib import Path

import pytest

from gdtool import __main__ as entry
from gdtool.core import modes
from gdtool.frontends import bench, options

ROOT = Path(__file__).resolve().parent.parent
FOUR = ("run", "bench", "profile", "sweep")
ROLLOUT = "bench --workload rollout"
# A list of two items for each option docs/cli.md may call a list option: what the list check parses.
TWO_ITEMS = {"--model": ["tiny-llama", "tiny-qwen3"], "--mode": ["eager", "step-graph"], "--batch": ["1", "4"],
             "--poll": ["1", "async"], "--kernels": ["hf", "compiled"], "--lengths": ["fixed:2", "geom:8:32"]}


@pytest.fixture(scope="module")
def table():
    return options.option_table()


def _command(command: str) -> tuple[str, ...]:
    """The parsers a command's name covers: bench is both its workloads."""
    return ("bench", ROLLOUT) if command == "bench" else (command,)


def takes(table, command: str, option: str) -> bool:
    return any(option in table[parser] for parser in _command(command))


def build_parser(command: str) -> argparse.ArgumentParser:
    return importlib.import_module(options.COMMANDS[command]).parser()


def shared(table) -> set[str]:
    """The options all four commands take (by their first spelling; bench: either workload)."""
    names = {a.option_strings[0] for known in table.values() for a in known.values()}
    return {name for name in names if all(takes(table, command, name) for command in FOUR)}


# -- docs/cli.md passage ---------------------------------------------------------------------

def readme_passage() -> str:
    """docs/cli.md's passage that says the commands speak one grammar, through the end of its table."""
    text = (ROOT / "docs" / "cli.md").read_text()
    start = text.index("All four speak one grammar")
    return text[start:text.index("\n\n", text.index("\n| option |", start) + 1)]


def _ticked(text: str) -> list[str]:
    return re.findall(r"`(--[\w-]+)`", text)


def readme_all_four(passage: str) -> list[str]:
    sentence = re.search(r"All four take (.*?)\.\s", passage, re.S)
    assert sentence, "docs/cli.md's grammar passage has no sentence 'All four take `--a`, `--b` ... .'"
    return _ticked(sentence.group(1))


def readme_aliases(passage: str) -> list[str]:
    part = re.search(r"the old spellings (.*?) still work", passage, re.S)
    assert part, "docs/cli.md's grammar passage no longer names the old spellings ('the old spellings ... still work')"
    return _ticked(part.group(1))


def readme_table(passage: str) -> tuple[list[str], dict[str, dict[str, bool]]]:
    """(its command columns, {option: {"list": bool, command: bool}}): a cell marked ✓ is True."""
    lines = [line.strip() for line in passage.splitlines() if line.strip().startswith("|")]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    assert header[:2] == ["option", "list"], header
    rows = {}
    for line in lines[2:]:
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        assert len(cells) == len(header), line
        assert all(cell in ("", "✓") for cell in cells[1:]), line
        rows[cells[0].strip("`")] = {column: cell == "✓" for column, cell in zip(header[1:], cells[1:])}
    return header[2:], rows


def test_the_readme_names_exactly_the_options_all_four_take(table):
    named = readme_all_four(readme_passage())
    assert len(named) == len(set(named)), named
    assert set(named) == shared(table), (
        f"docs/cli.md says all four take {sorted(named)}; their parsers share {sorted(shared(table))}")


def test_the_readme_table_is_what_the_parsers_take(table):
    columns, rows = readme_table(readme_passage())
    assert columns == list(options.COMMANDS), f"the table's columns {columns}; the parsers are {list(options.COMMANDS)}"
    wrong = [f"{option} on {command}: docs/cli.md says {'yes' if said else 'no'}"
             for option, row in rows.items() for command in columns
             for said in [row[command]] if said != (option in table[command])]
    assert not wrong, wrong
    assert all(any(row[c] for c in columns) for row in rows.values()), "a row of the table no command takes"
    marked_by_all = {option for option, row in rows.items()
                     if row["run"] and (row["bench"] or row[ROLLOUT]) and row["profile"] and row["sweep"]}
    assert marked_by_all == set(readme_all_four(readme_passage()))


def test_the_table_holds_every_option_two_commands_take(table):
    """An option two commands share is part of the grammar: the table says who takes it."""
    _, rows = readme_table(readme_passage())
    names = {a.option_strings[0] for known in table.values() for a in known.values()}
    two = {name for name in names if sum(takes(table, command, name) for command in FOUR) >= 2}
    assert two - set(rows) == set(), "options two or more commands take that docs/cli.md's table leaves out"


def test_an_option_called_a_list_takes_one_on_every_command_that_has_it(table):
    _, rows = readme_table(readme_passage())
    for option, row in rows.items():
        for command in options.COMMANDS:
            if not row[command]:
                continue
            action = table[command][option]
            is_list = isinstance(action, options.ListAction)
            assert is_list == row["list"], f"{option} on {command}: docs/cli.md says list={row['list']}"
            if not is_list:
                continue
            assert option in TWO_ITEMS, f"give {option} two values in TWO_ITEMS to check its lists"
            parser = build_parser(command)
            items = TWO_ITEMS[option]
            spaces = getattr(parser.parse_args([option, *items]), action.dest)
            commas = getattr(parser.parse_args([option, ",".join(items)]), action.dest)
            assert len(spaces) == len(commas) == 2 and spaces == commas, (command, option, spaces, commas)



def test_the_old_spellings_work_wherever_their_option_does(table):
    aliases = readme_aliases(readme_passage())
    assert aliases
    for alias in aliases:
        actions = {a.option_strings[0]: a for known in table.values() for a in known.values() if alias in a.option_strings}
        assert len(actions) == 1, f"{alias} spells {sorted(actions) or 'no option'}"
        (main,) = actions
        assert main != alias, f"{alias} is an option's first spelling, not an old one"
        missing = [command for command, known in table.items() if main in known and alias not in known]
        assert not missing, f"{alias} (old {main}) is refused by {missing}"


def test_python_m_gdtool_help_says_the_same(table):
    """`python -m gdtool --help` (gdtool/__main__.py's docstring) names the shared options and whose the others are."""
    doc = " ".join(entry.__doc__.split())
    listed = re.search(r"these options \([\w.]+\): (.*?);", doc)
    assert listed, "gdtool/__main__.py's docstring no longer lists the options every command takes"
    assert set(re.findall(r"--[\w-]+", listed.group(1))) == shared(table)
    claims = re.findall(r"(--[\w-]+): ([\w ,-]+?)(?=[;)])", doc)
    assert claims, "gdtool/__main__.py's docstring no longer says whose --poll, --kernels and --lengths are"
    for option, commands in claims:
        said = {c.strip() for c in commands.split(",")}
        assert said == {c for c in options.COMMANDS if option in table[c]}, (option, said)


def test_an_option_a_command_lacks_is_one_line_naming_who_takes_it(capsys):
    cases = [(["run", "--lengths", "garbage"], "run", "--lengths is an option of bench --workload rollout and sweep, "
                                                      "not of run"),
             (["sweep", "--kernels=fast"], "sweep",
              "--kernels is an option of run, bench, bench --workload rollout and profile, not of sweep"),
             (["bench", "--workload", "rollout", "--poll", "4"], ROLLOUT,
              "--poll is an option of run, profile and sweep, not of bench --workload rollout"),
             (["run", "--no-such-option"], "run", "unrecognized arguments: --no-such-option (see")]
    for argv, command, message in cases:
        with pytest.raises(SystemExit) as exit_info:
            entry.main(argv)
        assert exit_info.value.code == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and err.startswith(f"python -m gdtool {command}: error:"), err
        assert message in err, err


# -- --kernels' help --------------------------------------------------------------------------

def _largest_fast_batch(paths) -> int:
    """Probe the function the fast forward decides with: the largest batch it gives its own kernels."""
    from gdtool.kernels import forward
    return max((b for b in range(1, 129) if forward.batch_path(b, paths)[0] == "gemv"), default=0)


def test_kernels_help_names_every_option_family_and_batch_limit(table):
    from gdtool.kernels import dot, forward, linear
    from gdtool.kernels.experts import blocks as experts   # where refusal() reads the MoE families and limits
    helps = {command: " ".join(known["--kernels"].help.split()) for command, known in table.items()
             if "--kernels" in known}
    assert set(helps) == {"run", "bench", "bench --workload rollout", "profile"}
    text = options.kernels_help()
    assert all(h == text for h in helps.values()), "each command's --kernels help is options.kernels_help()"
    assert [k for k in modes.KERNELS if not re.search(rf"(?<![\w-]){k} \(", text)] == []
    fast = text[text.index("fast ("):]
    whole = [c.removesuffix("ForCausalLM") for c in forward.FAMILIES]
    blocks = [experts_cls.removesuffix("Experts") for _, experts_cls, _ in experts.FAMILIES.values()]
    missing = [name for name in whole + blocks if not re.search(rf"(?<![\w]){re.escape(name)}(?![\w])", fast)]
    assert not missing, f"--kernels' help leaves out families the fast step runs: {missing}"
    # the batch limits, as the deciding function gives them
    for largest, _ in forward.measured_lines():
        hidden = largest if largest is not None else 1 << 20
        rows = _largest_fast_batch(forward.line_paths(hidden))
        said = f"batch 1-{rows}" if rows > 1 else "batch 1"
        assert f"{said} up to hidden size {largest}" in fast if largest else f"{said} wider" in fast, (said, fast)
    assert f"at batch <= {_largest_fast_batch(forward.line_paths(None))};" in fast
    assert f"at batch <= {experts.MAX_GROUPED_TOKENS}" in fast and f"<= {linear.MAX_ROWS} (<= {dot.MAX_ROWS} on the tensor cores" in fast
    if set(experts.FAMILIES) - set(experts.GROUPED_FAMILIES):
        assert f"<= {experts.MAX_TOKENS})" in fast


def test_kernels_help_follows_the_tables(monkeypatch):
    """A family or a limit added to the code shows in the help without an edit to it."""
    from gdtool.kernels import forward
    from gdtool.kernels.experts import blocks as experts
    monkeypatch.setattr(forward, "FAMILIES", forward.FAMILIES + ("Phi3ForCausalLM",))
    monkeypatch.setattr(experts, "MAX_GROUPED_TOKENS", 96)
    monkeypatch.setattr(modes, "KERNELS_RUN", {**modes.KERNELS_RUN, "faster": "not yet"})
    text = options.kernels_help()
    assert "Phi3" in text and "at batch <= 96" in text and "or faster (not yet)" in text


def test_bench_refuses_rollout_options_with_its_own_line(capsys):
    """The decode workload names --workload rollout for the rollout workload's options (bench.ROLLOUT_ONLY), before
    argparse would: what the table's two bench columns mean."""
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--lengths", "geom:8:32"])
    assert exit_info.value.code == 2
    assert "--lengths is an option of --workload rollout" in capsys.readouterr().err
