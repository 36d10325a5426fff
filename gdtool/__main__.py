"""`python -m gdtool <command> ...`

    run       decode in one or all modes and compare them                 (gdtool.frontends.run)
    bench     gdtool's modes against generate() and a gpt-fast-style step  (gdtool.frontends.bench)
              --workload rollout: gdtool.rollout against HF continuous batching (gdtool.frontends.rollout_bench)
    profile   per-step host vs device time, in-process or under Nsight Systems (--nsys, --read)
                                                                          (gdtool.frontends.profile)
    sweep     EOS-polling x batch-size grids to CSV                       (gdtool.frontends.sweep)

Every command takes --help, and these options (gdtool.frontends.options): --model, --mode, --batch,
--prompt-len, --max-new-tokens, --seed, --json, --no-progress; lists with spaces or commas (--batch 1 4 16
or --batch 1,4,16). The others are some commands' own (docs/cli.md's table says whose; --poll: run, profile,
sweep; --kernels: run, bench (both workloads), profile; --lengths: sweep, bench --workload rollout). bench, profile and sweep
write results to --out (default under results/) and print where; run writes no file.
"""
import importlib
import sys

COMMANDS = {"run": "gdtool.frontends.run", "bench": "gdtool.frontends.bench", "profile": "gdtool.frontends.profile",
            "sweep": "gdtool.frontends.sweep"}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"python -m gdtool: error: unknown command {command!r}; use one of {', '.join(COMMANDS)} "
              "(python -m gdtool --help)", file=sys.stderr)
        return 2
    return importlib.import_module(COMMANDS[command]).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
