"""Build the NVTX injection library in hook.c and run Python code under it.

    lib = build(tmp_dir)                                   # gcc hook.c -> tmp_dir/libnvtx_hook.so
    events = record(lib, "import gdtool ...", tmp_dir)     # list[Event], in call order
    tree(events)                                           # nested (name, payload, children) of domain gdtool

`build` raises `HookUnavailable` (with the reason) when no C compiler is found; tests turn it into a skip.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

SOURCE = Path(__file__).with_name("hook.c")


class HookUnavailable(RuntimeError):
    pass


class Event(NamedTuple):
    kind: str            # "push" or "pop"
    tid: int
    domain: str          # "-" for the default domain
    message: str | None  # None on pops
    payload: object      # int for an int64 payload, None for none, else the raw "type:value" text


def build(dest_dir) -> Path:
    """Compile hook.c into a shared library under `dest_dir` and return its path."""
    compiler = os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")
    if not compiler:
        raise HookUnavailable("no C compiler (gcc/cc, or $CC) to build the NVTX hook; install gcc to run these tests")
    lib = Path(dest_dir) / "libnvtx_hook.so"
    cmd = [compiler, "-shared", "-fPIC", "-O2", "-Wall", "-o", str(lib), str(SOURCE), "-lpthread"]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise HookUnavailable(f"building the NVTX hook failed ({' '.join(cmd)}):\n{done.stderr}")
    return lib


def hook_env(lib, log=None, **extra) -> dict:
    """Environment for a child process under the hook (recording to `log`, or a no-op tool without it)."""
    env = {k: v for k, v in os.environ.items() if k not in ("NVTX_DISABLE", "NVTX_HOOK_LOG")}
    env["NVTX_INJECTION64_PATH"] = str(lib)
    if log is not None:
        env["NVTX_HOOK_LOG"] = str(log)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(Path(__file__).resolve().parents[2]),
                                                    env.get("PYTHONPATH")) if p)
    env.update({k: str(v) for k, v in extra.items()})
    return env


def record(lib, code: str, work_dir, timeout: float = 300, **extra_env) -> list[Event]:
    """Run `code` in a fresh Python under the hook; return the NVTX events it emitted."""
    log = Path(work_dir) / f"nvtx_events_{os.getpid()}_{len(list(Path(work_dir).glob('nvtx_events_*')))}.tsv"
    done = subprocess.run([sys.executable, "-c", code], env=hook_env(lib, log, **extra_env), check=False,
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"child process failed ({done.returncode}):\n{done.stdout}\n{done.stderr}")
    return parse(log.read_text() if log.exists() else "")


def parse(text: str) -> list[Event]:
    events = []
    for line in text.splitlines():
        fields = line.split("\t")
        if fields[0] == "push":
            _, tid, domain, message, payload = fields
            if payload == "-":
                value = None
            elif payload.startswith("i64:"):
                value = int(payload[4:])
            else:
                value = payload
            events.append(Event("push", int(tid), domain, message, value))
        elif fields[0] == "pop":
            events.append(Event("pop", int(fields[1]), fields[2], None, None))
        else:
            raise ValueError(f"unexpected line in the NVTX hook log: {line!r}")
    return events


def tree(events, domain: str = "gdtool") -> list:
    """Nest one thread's push/pop events of `domain` into [(name, payload, children), ...]."""
    roots: list = []
    stack: list = []
    tids = {e.tid for e in events if e.domain == domain}
    if len(tids) > 1:
        raise ValueError(f"events of domain {domain!r} come from {len(tids)} threads; expected one")
    for event in events:
        if event.domain != domain:
            continue
        if event.kind == "push":
            node = (event.message, event.payload, [])
            (stack[-1][2] if stack else roots).append(node)
            stack.append(node)
        else:
            if not stack:
                raise ValueError("pop without a matching push")
            stack.pop()
    if stack:
        raise ValueError(f"{len(stack)} ranges left open: {[n[0] for n in stack]}")
    return roots
