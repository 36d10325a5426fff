"""What one gdtool range costs on the host, with and without an NVTX tool attached.

Each configuration runs in a fresh Python (ranges decide at import whether a tool is attached):

    no-tool           nothing attached: nvtx hands out its dummy domain, ranges skip NVTX
    NVTX_DISABLE=1    same, decided by the environment variable
    disable+hook      NVTX_DISABLE=1 under the hook: NVTX_DISABLE wins over an attached tool
    hook-noop         the injection library of hook.c attached but not recording: the client side alone
    hook-recording    the same library writing every event to a file (a cheap tool; others cost more)
    nsys              under `nsys profile -t nvtx` (only when nsys is on PATH, or with --nsys)

Figures are ns per range (push + pop), the best of 15 repetitions of 50k ranges, loop overhead
included. Usage, from the repository root:

    python tests/nvtx_hook/cost.py            # prints a table, then one JSON line
    python tests/nvtx_hook/cost.py --nsys     # also under Nsight Systems (fails if nsys is missing)
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nvtx_hook import HookUnavailable, build, hook_env

CHILD = r"""
import json, timeit
from gdtool.core import ranges
from gdtool.core.ranges import span, push, pop, STEP, FORWARD

class NoopListener:
    def push(self, name, payload): pass
    def pop(self, name): pass

def best(stmt, setup="pass", number=50_000, repeat=15):
    times = timeit.repeat(stmt, setup=setup, globals=globals(), number=number, repeat=repeat)
    return round(min(times) / number * 1e9, 1)

payloads = list(range(1, 65))
result = {
    "enabled": ranges.enabled(),
    "span_payload_ns": best("with span(STEP, payloads[i & 63]): pass\ni += 1", setup="i = 0"),
    "span_ns": best("with span(FORWARD): pass"),
    "push_pop_ns": best("push(FORWARD); pop(FORWARD)"),
    "empty_loop_ns": best("pass"),
}
ranges.add_listener(NoopListener())
result["span_payload_1_listener_ns"] = best("with span(STEP, payloads[i & 63]): pass\ni += 1", setup="i = 0")
print(json.dumps(result))
"""


def run(cmd, env) -> dict:
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


def main(argv: list[str]) -> int:
    want_nsys = "--nsys" in argv
    repo = Path(__file__).resolve().parents[2]
    base = {k: v for k, v in os.environ.items() if k not in ("NVTX_DISABLE", "NVTX_INJECTION64_PATH", "NVTX_HOOK_LOG")}
    base["PYTHONPATH"] = os.pathsep.join(p for p in (str(repo), base.get("PYTHONPATH")) if p)
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        py = [sys.executable, "-c", CHILD]
        results["no-tool"] = run(py, base)
        results["NVTX_DISABLE=1"] = run(py, dict(base, NVTX_DISABLE="1"))
        try:
            lib = build(tmp)
        except HookUnavailable as err:
            print(f"skipping the hook configurations: {err}", file=sys.stderr)
        else:
            results["disable+hook"] = run(py, hook_env(lib, NVTX_DISABLE="1"))
            results["hook-noop"] = run(py, hook_env(lib))
            results["hook-recording"] = run(py, hook_env(lib, Path(tmp) / "events.tsv"))
        nsys = shutil.which("nsys")
        if want_nsys and not nsys:
            raise SystemExit("--nsys given but nsys is not on PATH")
        if nsys:
            cmd = [nsys, "profile", "-t", "nvtx", "--sample=none", "--cpuctxsw=none", "-o", str(Path(tmp) / "cost"),
                   "--force-overwrite", "true"] + py
            results["nsys"] = run(cmd, base)
    keys = ["span_payload_ns", "span_ns", "push_pop_ns", "span_payload_1_listener_ns", "empty_loop_ns"]
    print(f"{'configuration':<16} {'nvtx on':>7} " + " ".join(f"{k:>27}" for k in keys))
    for name, r in results.items():
        print(f"{name:<16} {r['enabled']!s:>7} " + " ".join(f"{r[k]:>27}" for k in keys))
    import nvtx
    meta = {"python": platform.python_version(), "machine": platform.machine(), "processor": platform.processor(),
            "nvtx": getattr(nvtx, "__version__", None) or _dist_version("nvtx")}
    print(json.dumps({"unit": "ns per range", "results": results, "env": meta}))
    return 0


def _dist_version(name):
    from importlib.metadata import version
    return version(name)


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
