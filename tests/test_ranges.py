"""gdtool's NVTX ranges, seen by a real NVTX tool.

The tool is tests/nvtx_hook/hook.c, an NVTX injection library built here with the C compiler and
loaded by NVTX itself (NVTX_INJECTION64_PATH) in a child Python: what it records is what the `nvtx`
package really emits, registered strings and int64 payloads included, as Nsight Systems would see it.
"""
from __future__ import annotations

import json

import pytest
from nvtx_hook import HookUnavailable, build, tree

from gdtool.core import ranges


@pytest.fixture(scope="session")
def hook(tmp_path_factory):
    pytest.importorskip("nvtx", reason="the nvtx package is not installed: gdtool's ranges cannot reach a tool")
    try:
        return build(tmp_path_factory.mktemp("nvtx_hook"))
    except HookUnavailable as err:
        pytest.skip(str(err))


# -- in-process: listeners ------------------------------------------------------------------------

class Recorder:
    def __init__(self):
        self.calls = []

    def push(self, name, payload):
        self.calls.append(("push", name, payload))

    def pop(self, name):
        self.calls.append(("pop", name))


def test_listeners_see_push_pop_in_order_and_pops_on_exceptions():
    rec = Recorder()
    ranges.add_listener(rec)
    try:
        with ranges.span(ranges.DECODE, 3):
            with pytest.raises(KeyError), ranges.span(ranges.STEP, 1):
                raise KeyError("boom")
            ranges.push(ranges.PREFILL)
            ranges.pop(ranges.PREFILL)
    finally:
        ranges.remove_listener(rec)
    assert rec.calls == [("push", "decode", 3), ("push", "step", 1), ("pop", "step"),
                         ("push", "prefill", None), ("pop", "prefill"), ("pop", "decode")]
    with ranges.span(ranges.STEP, 2):  # removed: sees nothing more
        pass
    assert len(rec.calls) == 6


def test_count_syncs_reaches_listeners_that_take_it():
    class Syncs(Recorder):
        def syncs(self, n):
            self.calls.append(("syncs", n))

    plain, counting = Recorder(), Syncs()
    ranges.add_listener(plain)
    ranges.add_listener(counting)
    try:
        ranges.count_syncs()
        ranges.count_syncs(3)
    finally:
        ranges.remove_listener(plain)
        ranges.remove_listener(counting)
    assert plain.calls == [] and counting.calls == [("syncs", 1), ("syncs", 3)]


def test_listener_errors_name_the_fix():
    with pytest.raises(TypeError, match="push\\(name, payload\\) and pop\\(name\\)"):
        ranges.add_listener(object())
    with pytest.raises(ValueError, match="add_listener"):
        ranges.remove_listener(Recorder())


def test_names_are_the_contract_constants():
    assert ranges.DOMAIN == "gdtool"
    assert ranges.NAMES == ("decode", "prefill", "warm-up", "capture", "step", "forward", "select", "update",
                            "eos-check", "replay", "eos-poll")


# -- through the NVTX hook -------------------------------------------------------------------------

# One child per environment: each one pays for importing torch.
CHILD = r"""
import json
import torch
from gdtool.core import ranges

class Count:
    pushes = 0
    def push(self, name, payload): Count.pushes += 1
    def pop(self, name): pass

ranges.add_listener(Count())
with ranges.span(ranges.DECODE, 4):
    with ranges.span(ranges.PREFILL):
        pass
    for j in range(1, 4):
        with ranges.span(ranges.STEP, j):
            ranges.push(ranges.FORWARD)
            ranges.pop(ranges.FORWARD)
            with ranges.span(ranges.SELECT):
                pass
    ranges.push(ranges.STEP, 2**62)
    ranges.pop(ranges.STEP)
    ranges.push(ranges.STEP, -5)
    ranges.pop(ranges.STEP)
rejected = []
for bad in (1.5, torch.tensor(3), "3") if ranges.enabled() else ():  # checked where NVTX needs it
    try:
        ranges.push(ranges.STEP, bad)
    except TypeError as err:
        rejected.append("host int" in str(err))
print(json.dumps({"enabled": ranges.enabled(), "listener_pushes": Count.pushes, "rejected": rejected}))
"""

NESTED_TREE = [
    ("decode", 4, [
        ("prefill", None, []),
        ("step", 1, [("forward", None, []), ("select", None, [])]),
        ("step", 2, [("forward", None, []), ("select", None, [])]),
        ("step", 3, [("forward", None, []), ("select", None, [])]),
        ("step", 2**62, []),
        ("step", -5, []),
    ])]


def run_child(hook, tmp_path, **env):
    import subprocess
    import sys

    from nvtx_hook import hook_env, parse
    log = tmp_path / f"events{len(env)}.tsv"
    done = subprocess.run([sys.executable, "-c", CHILD], env=hook_env(hook, log, **env), capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    return parse(log.read_text() if log.exists() else ""), json.loads(done.stdout.splitlines()[-1])


def test_hook_sees_nesting_order_and_int64_payloads(hook, tmp_path):
    events, seen = run_child(hook, tmp_path)
    mine = [e for e in events if e.domain == "gdtool"]
    assert mine, "the hook saw no event in domain gdtool: ranges did not reach the NVTX tool"
    assert tree(events) == NESTED_TREE
    # The hook parses a payload as an int only when NVTX gave it NVTX_PAYLOAD_TYPE_INT64.
    assert all(type(e.payload) is int for e in mine if e.kind == "push" and e.message in ("decode", "step"))
    assert len({e.tid for e in mine}) == 1
    assert seen["enabled"] is True
    assert seen["listener_pushes"] == 13
    # float, tensor and str payloads are refused with a message naming the fix
    assert seen["rejected"] == [True, True, True]


def test_nvtx_disable_silences_the_tool_but_not_listeners(hook, tmp_path):
    events, seen = run_child(hook, tmp_path, NVTX_DISABLE="1")
    assert events == []
    assert seen["enabled"] is False
    assert seen["listener_pushes"] == 13
    # without an NVTX tool ranges skip NVTX and cost no validation


# -- the range tree of each decode mode -----------------------------------------------------------

def expected_tree(mode: str, batch: int, steps: int, poll) -> tuple:
    """The range tree of one decode, as docs/ranges.md draws it."""
    if mode == "device-loop":  # one launch, no per-step ranges (poll 0: unchunked)
        return (ranges.DECODE, batch, [(ranges.PREFILL, None, []), (ranges.WARMUP, None, []),
                                       (ranges.CAPTURE, None, []), (ranges.REPLAY, None, [])])
    check = ranges.EOS_POLL if mode == "step-graph" else ranges.EOS_CHECK
    eager = [ranges.FORWARD, ranges.SELECT, ranges.UPDATE]
    phases = {"eager": eager, "forward-graph": [ranges.REPLAY, ranges.SELECT], "step-graph": [ranges.REPLAY]}[mode]
    children = [(ranges.PREFILL, None, [])]
    if mode != "eager":
        children += [(ranges.WARMUP, None, []), (ranges.CAPTURE, None, [])]
    if poll != "async" and poll >= 1:
        children.append((check, None, []))  # the prefill token's flag, read before step 1
    for j in range(1, steps + 1):
        polled = poll == "async" or (poll >= 1 and j % poll == 0)
        children.append((ranges.STEP, j, [(name, None, []) for name in phases + ([check] if polled else [])]))
    return (ranges.DECODE, batch, children)


CASES = [("eager", 1), ("forward-graph", 1), ("step-graph", 16), ("step-graph", 2), ("step-graph", 0),
         ("device-loop", 0),
         ("step-graph", "async"), ("eager", "async")]

DECODES = r"""
import json
import gdtool
CASES, DEVICE = json.loads(%r), %r
model = gdtool.load_model("tiny-llama", seed=0, device=DEVICE)
padded = gdtool.random_prompts(model, batch=3, lengths=(2, 5), seed=0)
assert not bool(padded.attention_mask.all())
runs = [(mode, poll, padded, 6, {}) for mode, poll in CASES]
# EOS that stops the decode early: steps and polls end where the flag is read
runs.append(("step-graph", 2, padded, 12, dict(eos_token_id=[2], target_lengths=[3, 2, 4])))
if DEVICE == "cuda":  # no padding, full cache: the same tree
    unpadded = gdtool.random_prompts(model, batch=2, lengths=(4, 4), seed=0)
    runs += [(mode, 1, unpadded, 5, {}) for mode in ("forward-graph", "step-graph")]
for mode, poll, prompt, n, extra in runs:
    extra.setdefault("eos_token_id", None)
    out = gdtool.decode(model, prompt.input_ids, prompt.attention_mask, mode=mode, max_new_tokens=n,
                        eos_poll_interval=poll, seed=0, **extra)
    print(json.dumps(dict(mode=mode, poll=poll, steps=out.steps, polls=out.polls, batch=out.batch,
                          replays=out.replays)))
"""


def check_range_trees(hook, tmp_path, device):
    import subprocess
    import sys

    from nvtx_hook import hook_env, parse
    log = tmp_path / "events.tsv"
    code = DECODES % (json.dumps(CASES), device)
    done = subprocess.run([sys.executable, "-c", code], env=hook_env(hook, log), capture_output=True, text=True,
                          timeout=600, check=False)
    assert done.returncode == 0, done.stderr
    runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [(r["mode"], r["poll"]) for r in runs[:len(CASES)]] == [tuple(c) for c in CASES]
    roots = tree(parse(log.read_text()))
    assert len(roots) == len(runs), [r[0] for r in roots]
    for run, root in zip(runs, roots):
        label = f"{run['mode']} eos_poll_interval={run['poll']}"
        assert 1 <= run["steps"], label
        assert root == expected_tree(run["mode"], run["batch"], run["steps"], run["poll"]), label
        checks = sum(1 for node in _walk(root) if node[0] in (ranges.EOS_CHECK, ranges.EOS_POLL))
        assert checks == run["polls"], label
    early = runs[len(CASES)]
    assert early["steps"] == 4 and early["polls"] == 3  # rows end at 3, 2, 4 tokens: the flag is up after step 3
    return runs


def test_range_tree_of_each_mode(hook, tmp_path):
    check_range_trees(hook, tmp_path, "cpu")


@pytest.mark.cuda
def test_range_tree_of_each_mode_on_gpu(hook, tmp_path):
    runs = check_range_trees(hook, tmp_path, "cuda")
    assert [r["replays"] == r["steps"] for r in runs[-2:]] == [True, True]  # the unpadded decodes


def _walk(node):
    yield node
    for child in node[2]:
        yield from _walk(child)
