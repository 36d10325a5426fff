"""Measurement: what a decode costs, host vs device, and the records results are kept in.

    timing.py     host vs device time per step, in-process (`profile`)
    nsys/         Nsight Systems: run a session, read its sqlite export as one row per step
    workloads.py  per-row response lengths drawn from a named distribution
    polls.py      EOS polling policies and their labels
    costmodel.py  what EOS polling costs: predict tokens/s from a few numbers per batch size
    record.py     one result record: run-config names and hashes, CSV + JSON sidecar, resume
    accuracy.py   kernels against kernels: teacher-forced logits of the compiled or fast step against HF's
                  kernels (`compare_kernels`) and against float32 (`accuracy`)
    roofline.py   the bytes a decode step must read and the device's copy bandwidth (`step_bytes`,
                  `copy_bandwidth`): the floor the bench measures against

It runs the loops and imports no command line: the front ends hand it their choices.
"""
