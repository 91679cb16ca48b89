"""kernels_bench: one script per question about feedpipe's performance, and a shared harness.

Run one with `python -m kernels_bench.<name> [--quick]`, or all with
`python -m kernels_bench.run_all [--quick]`; see README.md in this folder.
"""
