"""Where each mode leaves eager, for the fast-sweep case that failed on the H200 at 48346b3 and ten variants of it.

A one-off diagnosis kept as it ran (the tree of 48346b3, output in `modes-48346b3.txt`), from the repository root:
`PYTHONPATH=$PWD python3 profiles/h200/tests/modes_48346b3.py` (one process per variant, bf16 on CUDA;
DIAG_DEVICE=cpu runs one variant in float32 on a CPU). Each variant decodes in every mode, and the step-graph also
uncaptured; each line says where its tokens and scores first differ from eager's."""
import dataclasses, json, os, subprocess, sys, time
sys.path.insert(0, "tests")
import fastcases

BASE = [c for c in fastcases.cases(3, seed=1) if c.seed == 5193][0]
R = dataclasses.replace
VARIANTS = {
    "base": (BASE, "fast"),
    "compiled": (BASE, "compiled"),
    "hf": (BASE, "hf"),
    "eosoff": (R(BASE, eos=None), "fast"),
    "greedy": (R(BASE, sampling=False), "fast"),
    "poll1": (R(BASE, poll=1), "fast"),
    "b8line0": (R(BASE, batch=8, pads=BASE.pads[:8], line=0, eos=(2, 6)), "fast"),
    "wide": (R(BASE, model="mistral-wide"), "fast"),
    "nopads": (R(BASE, pads=(0,) * BASE.batch), "fast"),
    "b8line0-eosoff": (R(BASE, batch=8, pads=BASE.pads[:8], line=0, eos=None), "fast"),
    "greedy-eosoff": (R(BASE, sampling=False, eos=None), "fast"),
}


def one(name):
    import torch
    from gdtool.kernels.step import compiles, forget
    from reference import decode
    from windows import prompt
    case, kernels = VARIANTS[name]
    dev = os.environ.get("DIAG_DEVICE", "cuda")
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = fastcases.build(case.model, dev, dtype)
    ids, mask = prompt(case, dev)
    settings = dict(fastcases.SAMPLING) if case.sampling else dict(do_sample=False)
    settings.update(eos_token_id=None, pad_token_id=0)
    with fastcases.line(case.line):
        if case.eos is not None:
            tokens = decode(model, ids, mask, case.new_tokens, seed=case.seed, kernels=kernels, **settings).tokens
            settings["eos_token_id"] = int(tokens[case.eos])
        forget(model)
        outs = {}
        for mode, capture in (("eager", None), ("forward-graph", None), ("step-graph", None),
                              ("step-graph-uncaptured", False), ("device-loop", None), ("eager2", None)):
            m = mode.replace("-uncaptured", "").replace("eager2", "eager")
            poll = case.poll if m == "step-graph" else None
            outs[mode] = decode(model, ids, mask, case.new_tokens, seed=case.seed, mode=m, eos_poll_interval=poll,
                                capture=capture, kernels=kernels, **settings)
    lines = [f"{name}: {case.name} kernels={kernels} path={fastcases.path(case, dev, dtype)} eos_id={settings['eos_token_id']}"]
    ref = outs["eager"]
    for mode, out in outs.items():
        first = None
        for i, (a, b) in enumerate(zip(out.scores, ref.scores)):
            if not torch.equal(a.cpu(), b.cpu()):
                a, b = a.cpu(), b.cpu()
                fin = torch.isfinite(a) & torch.isfinite(b)
                rows = (~((a == b) | (torch.isinf(a) & torch.isinf(b) & (a == b)))).any(-1).nonzero().flatten().tolist()
                diff = (a - b)[fin].abs().max().item() if fin.any() else float("nan")
                inf = (torch.isinf(a) != torch.isinf(b)).sum().item()
                first = f"scores step {i}: rows {rows[:12]}{'...' if len(rows) > 12 else ''} ({len(rows)}), max finite diff {diff:.3g}, inf pattern differs at {inf}"
                break
        tok = out.tokens.cpu() != ref.tokens.cpu() if out.tokens.shape == ref.tokens.shape else None
        tinfo = "shape differs" if tok is None else (f"tokens differ at {tok.nonzero()[:6].tolist()} ({int(tok.sum())})" if tok.any() else "tokens same")
        lines.append(f"  {mode:22s} steps={out.steps} replays={getattr(out, 'replays', None)} len(scores)={len(out.scores)} {tinfo}; {first or 'scores same'}")
    import collections
    lines.append("  accounts: " + " | ".join(f"{n}x {k[:160]}" for k, n in collections.Counter(compiles(model).kernels.tolist()).items()))
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        one(sys.argv[1])
        sys.exit(0)
    start = time.time()
    names = list(VARIANTS)
    procs = {n: subprocess.Popen([sys.executable, __file__, n], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in names}
    for n, p in procs.items():
        try:
            out, _ = p.communicate(timeout=max(5, 225 - (time.time() - start)))
        except subprocess.TimeoutExpired:
            p.kill(); out = f"{n}: timed out\n"
        print(out[-3000:] if p.returncode == 0 else f"{n}: rc {p.returncode}\n{out[-2500:]}", flush=True)
    print(f"{time.time() - start:.0f} s")
