"""bench/README.md, covered whole (`COVERED`): each section's figures from the bench/results/
file its script writes, registered in one of five modules by what the section measures.
bench_step holds the train step and its memory (attention, long context, log-probs, RoPE, the
loop's memory, checkpoints, mixtures of experts, the step's breakdown, the GPU's checks);
bench_memory the step and the engine compiled at real sizes; bench_loop what runs around it
(verifiers, partial rollouts, weight syncs, quantized engines, hybrid switches); bench_runs whole
runs (RL iterations, multi-turn episodes); bench_peers the step and generation against the
peers. The rough lengths of the usage lines ("~6 minutes") are guides to running a command
rather than results, and are listed as such."""

from . import bench_loop, bench_memory, bench_peers, bench_runs, bench_step

COVERED = "bench/README.md"
FIGURES = (bench_step.FIGURES + bench_memory.FIGURES + bench_loop.FIGURES + bench_runs.FIGURES
           + bench_peers.FIGURES)
NOT_MEASURED = (bench_step.NOT_MEASURED + bench_memory.NOT_MEASURED + bench_loop.NOT_MEASURED
                + bench_runs.NOT_MEASURED + bench_peers.NOT_MEASURED)
GENERATED = ()
