"""thunder_tp's benchmarks: the entry points here, the helpers they share in ``lib/``, the projection to N GPUs with
its collectives decomposed in ``projection/``. Run an entry point as a module from the repository root:

    python -m benchmarks.bench_rank --quick
    torchrun --nproc-per-node 2 -m benchmarks.benchmark_litgpt --model_name pythia-14m --distributed_mode tp
"""
