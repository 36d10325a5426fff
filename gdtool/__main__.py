"""`python -m gdtool <command> ...`

    run       decode in one or all modes, summary + JSON line      (gdtool.cli)
    bench     gdtool's modes against generate() and a gpt-fast-style step (gdtool.bench)
    profile   per-step host vs device time; --nsys records Nsight Systems sessions (gdtool.timing, gdtool.nsys)
    sweep     EOS-polling x batch-size grids to CSV                (gdtool.sweep)
"""
import importlib
import sys

COMMANDS = {"run": "gdtool.cli", "bench": "gdtool.bench", "sweep": "gdtool.sweep", "profile": None}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        print(__doc__)
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    command, rest = argv[0], argv[1:]
    module = COMMANDS[command]
    if command == "profile":
        module = "gdtool.nsys" if "--nsys" in rest else "gdtool.timing"
    return importlib.import_module(module).main(rest) or 0


if __name__ == "__main__":
    sys.exit(main())
