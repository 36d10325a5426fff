"""One result record: the environment sidecar has the same keys from every command, configs are named
and hashed one way, results resume. (Imports between gdtool's modules: tests/test_layers.py.)"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pandas as pd
import pytest

from gdtool.frontends import bench
from gdtool.measure import nsys, record
from gdtool.frontends.profile import ProfileConfig
from gdtool.frontends.sweep import RunConfig

ROOT = Path(__file__).resolve().parent.parent


def test_environment_has_the_same_keys_everywhere():
    env = record.environment()
    assert tuple(env) == record.ENV_KEYS
    assert env["device"] == "cpu" and env["gpu"] is None and env["device_name"] == env["cpu"]
    assert env["git_commit"] and len(env["git_commit"]) == 40 and env["git_commit_source"] == "git"
    assert isinstance(env["git_dirty"], bool)
    assert tuple(record.environment(nsys=None)) == record.ENV_KEYS
    line = record.describe(env)
    assert "no CUDA GPU" in line and env["torch"] in line and env["git_commit"][:10] in line


def test_the_old_environment_names_warn_and_give_the_one_record():
    for old in (bench.environment, nsys.environment):
        with pytest.warns(DeprecationWarning, match="gdtool.measure.record.environment"):
            made = old()
        assert tuple(made) == record.ENV_KEYS


def test_commit_from_the_environment_where_there_is_no_git(monkeypatch):
    monkeypatch.setattr(record, "_run", lambda cmd, cwd=None: (128, ""))   # no git folder
    monkeypatch.setenv("GDTOOL_COMMIT", "0123456789abcdef")
    assert record.git_commit() == ("0123456789abcdef", None, "GDTOOL_COMMIT")
    monkeypatch.delenv("GDTOOL_COMMIT")
    assert record.git_commit() == (None, None, None)
    assert "commit unknown" in record.describe(dict(record.environment(), git_commit=None))


def test_an_explicit_commit_wins_over_the_git_folder_of_a_copy(monkeypatch):
    # a copy of a checkout can carry the git folder of an older commit: the caller's commit is the true one
    monkeypatch.setenv("GDTOOL_COMMIT", "fedcba9876543210")
    assert record.git_commit() == ("fedcba9876543210", None, "GDTOOL_COMMIT")


@dataclass(frozen=True)
class Point(record.Config):
    model: str
    batch: int
    tag: str = ""

    def name_parts(self):
        return [self.model, f"b{self.batch}", self.tag]


def test_config_name_and_hash():
    a = Point("llama-1b", 16)
    assert a.name == "llama-1b_b16" and Point("x/y z", 1, "k+v").name == "x-y-z_b1_k+v"
    assert a.hash == Point("llama-1b", 16).hash == record.config_hash({"model": "llama-1b", "batch": 16, "tag": ""})
    assert len(a.hash) == 12 and a.hash != Point("llama-1b", 17).hash and a.config_hash == a.hash
    assert a.columns() == {"model": "llama-1b", "batch": 16, "tag": "", "name": a.name, "config_hash": a.hash}


def test_every_command_names_its_configs_this_way():
    # the hash of a sweep config is what it was before the record module (committed CSVs resume)
    import hashlib
    from dataclasses import asdict
    cfg = RunConfig("llama-1b", "step-graph", 16, 16, "geom:128:512", 512)
    assert cfg.hash == hashlib.sha1(json.dumps(asdict(cfg), sort_keys=True).encode()).hexdigest()[:12]
    assert cfg.name == "llama-1b_b16_poll16_step-graph_geom128cap512"
    assert nsys.TraceConfig("llama-1b", 1, "eager", "graph", eos=False).name == "llama-1b_b1_eager_graph_noeos"
    assert ProfileConfig("llama-1b", 1, "step-graph", eos=False, kernels="compiled").name == \
        "llama-1b_b1_step-graph_compiled_noeos"
    for c in (cfg, nsys.TraceConfig("m", 1, "eager", "node"), bench.BenchConfig("m", 1), ProfileConfig("m", 1, "eager")):
        assert isinstance(c, record.Config) and len(c.hash) == 12


def test_results_resume_by_config_hash(tmp_path):
    path = tmp_path / "r.csv"
    a, b = Point("m", 1), Point("m", 2)
    results = record.Results(path)
    assert results.count(a) == (0, False)
    results.add([dict(a.columns(), repeat=0, error=""), dict(a.columns(), repeat=1, error="")])
    results.add([dict(b.columns(), repeat=0, error="RuntimeError: boom")])
    results.save()
    again = record.Results(path)
    assert again.count(a) == (2, False) and again.count(b) == (0, True)
    again.drop(b, errors_only=True)
    again.replace(a, [dict(a.columns(), repeat=0, error="")])
    again.save()
    back = pd.read_csv(path)
    assert list(back.columns[:2]) == ["name", "config_hash"] and len(back) == 1
    assert not list(tmp_path.glob("*.tmp"))  # written atomically


def test_sidecar_keeps_sessions_and_earlier_environments(tmp_path):
    path = tmp_path / "s.json"
    env = record.environment()
    record.write_sidecar(path, env, session={"configs": 2}, columns_doc="x")
    doc = record.write_sidecar(path, dict(env, gpu="NVIDIA H200"), session={"configs": 3})
    assert [s["configs"] for s in doc["sessions"]] == [2, 3]
    assert doc["environment"]["gpu"] == "NVIDIA H200" and doc["earlier_environments"][0]["gpu"] is None
    assert record.read_sidecar(path) == json.loads(path.read_text()) and record.read_sidecar(tmp_path / "no") == {}


@pytest.mark.parametrize("folder", ["profile", "nsys-graph", "bench/llama-1b"])
def test_committed_sidecars_still_read(folder):
    for path in (ROOT / "profiles" / "h200" / folder).glob("*.json"):
        assert record.read_sidecar(path), path
