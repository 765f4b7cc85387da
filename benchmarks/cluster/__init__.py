"""The cluster rehearsal: trainer and inference "hosts" as network namespaces on one machine (root).

rehearse.py          `make rehearse-cluster`: DDP and FSDP2 across two nodes, served sampling, faults
netns.py             the namespaces themselves; `python -m benchmarks.cluster.netns probe|cleanup`
allreduce_probe.py   the first health check, run by torchrun on every node
"""
